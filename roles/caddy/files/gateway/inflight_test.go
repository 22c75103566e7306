package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/filestorage" // storage in the test's own directory
	_ "github.com/caddyserver/caddy/v2/modules/logging"     // the access log's file writer and JSON encoder
)

// provisioned returns a handler keyed by the {user} placeholder, provisioned in a fresh Caddy context.
func provisioned(t *testing.T, limit string) *Handler {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	h := &Handler{Key: "{user}", Limit: limit}
	if err := h.Provision(ctx); err != nil {
		t.Fatalf("provision: %v", err)
	}
	t.Cleanup(func() {
		_ = h.Cleanup()
		cancel()
	})
	return h
}

// request builds a request carrying a replacer with user (and the per-user limit in {limit}).
func request(ctx context.Context, user, limit string) *http.Request {
	repl := caddy.NewReplacer()
	repl.Set("user", user)
	repl.Set("limit", limit)
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil).WithContext(ctx)
	return r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
}

// blockingNext holds every request until release is closed or the request's context ends, like a
// proxied stream that lasts until the engine finishes or the client hangs up.
type blockingNext struct {
	started chan struct{}
	release chan struct{}
}

func newBlockingNext() *blockingNext {
	return &blockingNext{started: make(chan struct{}, 1024), release: make(chan struct{})}
}

func (b *blockingNext) ServeHTTP(w http.ResponseWriter, r *http.Request) error {
	b.started <- struct{}{}
	w.WriteHeader(http.StatusOK)
	select {
	case <-b.release:
	case <-r.Context().Done():
	}
	return nil
}

func TestCapEnforcedUnderConcurrency(t *testing.T) {
	const limit, clients = 3, 40
	h := provisioned(t, "3")
	next := newBlockingNext()
	var ok, refused atomic.Int64
	var wg sync.WaitGroup
	for i := 0; i < clients; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w := httptest.NewRecorder()
			if err := h.ServeHTTP(w, request(context.Background(), "alice", ""), next); err != nil {
				t.Error(err)
			}
			switch w.Code {
			case http.StatusOK:
				ok.Add(1)
			case http.StatusTooManyRequests:
				refused.Add(1)
			default:
				t.Errorf("status %d", w.Code)
			}
		}()
	}
	// Exactly `limit` get through; everyone else is refused at once, without waiting for a slot.
	for i := 0; i < limit; i++ {
		<-next.started
	}
	deadline := time.Now().Add(5 * time.Second)
	for refused.Load() < clients-limit && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if n, _ := h.counters.inFlight("alice"); n != limit {
		t.Fatalf("in flight %d, want %d", n, limit)
	}
	close(next.release)
	wg.Wait()
	if ok.Load() != limit || refused.Load() != clients-limit {
		t.Fatalf("ok=%d refused=%d, want %d and %d", ok.Load(), refused.Load(), limit, clients-limit)
	}
	if n, keys := h.counters.inFlight("alice"); n != 0 || keys != 0 {
		t.Fatalf("after completion: in flight %d, keys %d; want 0 and 0 (entry removed)", n, keys)
	}
}

func TestSlotReleasedOnCompletionCancelAndPanic(t *testing.T) {
	h := provisioned(t, "1")
	done := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return nil })
	statusOf := func(ctx context.Context, next caddyhttp.Handler) int {
		w := httptest.NewRecorder()
		_ = h.ServeHTTP(w, request(ctx, "bob", ""), next)
		return w.Code
	}

	// Completion.
	if code := statusOf(context.Background(), done); code != http.StatusOK {
		t.Fatalf("first request: %d", code)
	}
	if code := statusOf(context.Background(), done); code != http.StatusOK {
		t.Fatalf("after completion the slot should be free, got %d", code)
	}

	// Client hang-up: the stream holds the slot until its context is cancelled.
	next := newBlockingNext()
	ctx, cancel := context.WithCancel(context.Background())
	finished := make(chan int)
	go func() { finished <- statusOf(ctx, next) }()
	<-next.started
	if code := statusOf(context.Background(), done); code != http.StatusTooManyRequests {
		t.Fatalf("while a stream runs: %d, want 429", code)
	}
	cancel()
	<-finished
	if code := statusOf(context.Background(), done); code != http.StatusOK {
		t.Fatalf("after the client hung up: %d, want 200", code)
	}

	// Panic in a later handler.
	boom := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { panic("boom") })
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("the panic should propagate")
			}
		}()
		statusOf(context.Background(), boom)
	}()
	if n, keys := h.counters.inFlight("bob"); n != 0 || keys != 0 {
		t.Fatalf("after a panic: in flight %d, keys %d", n, keys)
	}

	// An error from a later handler releases too.
	fail := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return errors.New("upstream") })
	if err := h.ServeHTTP(httptest.NewRecorder(), request(context.Background(), "bob", ""), fail); err == nil {
		t.Fatal("the error should propagate")
	}
	if n, _ := h.counters.inFlight("bob"); n != 0 {
		t.Fatalf("after an error: in flight %d", n)
	}
}

func TestKeysAreIndependentAndLimitsPerKey(t *testing.T) {
	h := provisioned(t, "{limit}")
	next := newBlockingNext()
	defer close(next.release)
	status := func(user, limit string) int {
		w := httptest.NewRecorder()
		ch := make(chan struct{})
		go func() { _ = h.ServeHTTP(w, request(context.Background(), user, limit), next); close(ch) }()
		select {
		case <-next.started:
			return http.StatusOK // admitted and now held
		case <-ch:
			return w.Code
		}
	}
	// alice may have 1, bob 2: alice's full bucket does not touch bob's.
	if status("alice", "1") != http.StatusOK || status("alice", "1") != http.StatusTooManyRequests {
		t.Fatal("alice: want one admitted, the second refused")
	}
	if status("bob", "2") != http.StatusOK || status("bob", "2") != http.StatusOK {
		t.Fatal("bob: want two admitted while alice is full")
	}
	if status("bob", "2") != http.StatusTooManyRequests {
		t.Fatal("bob: the third should be refused")
	}
	if _, keys := h.counters.inFlight("alice"); keys != 2 {
		t.Fatalf("keys in flight %d, want 2", keys)
	}
}

func TestRefusalBodyAndHeaders(t *testing.T) {
	h := provisioned(t, "1")
	h.RetryAfter = 3
	next := newBlockingNext()
	defer close(next.release)
	go func() { _ = h.ServeHTTP(httptest.NewRecorder(), request(context.Background(), "carol", ""), next) }()
	<-next.started
	w := httptest.NewRecorder()
	if err := h.ServeHTTP(w, request(context.Background(), "carol", ""), next); err != nil {
		t.Fatal(err)
	}
	if w.Code != http.StatusTooManyRequests {
		t.Fatalf("status %d", w.Code)
	}
	if got := w.Header().Get("Retry-After"); got != "3" {
		t.Fatalf("Retry-After %q", got)
	}
	if got := w.Header().Get("Content-Type"); got != "application/json" {
		t.Fatalf("Content-Type %q", got)
	}
	var body map[string]map[string]any
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
		t.Fatalf("body %q: %v", w.Body.String(), err)
	}
	e := body["error"]
	if e["code"] != "concurrency_limit_exceeded" || e["type"] != "requests" || e["param"] != nil {
		t.Fatalf("error %v", e)
	}
	if _, present := e["param"]; !present || !strings.Contains(e["message"].(string), "limit 1") {
		t.Fatalf("error %v", e)
	}
}

func TestUnusableLimitFailsClosed(t *testing.T) {
	h := provisioned(t, "{limit}")
	called := false
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { called = true; return nil })
	for _, limit := range []string{"", "zero", "0", "-2"} {
		err := h.ServeHTTP(httptest.NewRecorder(), request(context.Background(), "dave", limit), next)
		var he caddyhttp.HandlerError
		if !errors.As(err, &he) || he.StatusCode != http.StatusInternalServerError {
			t.Fatalf("limit %q: want a 500 handler error, got %v", limit, err)
		}
	}
	if called {
		t.Fatal("a request with no usable limit must not reach the upstream")
	}
}

func TestCountersSurviveAReload(t *testing.T) {
	old := provisioned(t, "1")
	next := newBlockingNext()
	defer close(next.release)
	go func() { _ = old.ServeHTTP(httptest.NewRecorder(), request(context.Background(), "erin", ""), next) }()
	<-next.started
	// The new config is provisioned before the old one is cleaned up (a graceful reload).
	fresh := provisioned(t, "1")
	_ = old.Cleanup()
	old.poolKey = ""
	w := httptest.NewRecorder()
	_ = fresh.ServeHTTP(w, request(context.Background(), "erin", ""), next)
	if w.Code != http.StatusTooManyRequests {
		t.Fatalf("a request still running under the old config must count under the new one: %d", w.Code)
	}
}

func TestCaddyfile(t *testing.T) {
	cases := []struct {
		in, key, limit, errPart string
		retry                   int
	}{
		{in: "inflight_limit {user} 4", key: "{user}", limit: "4"},
		{in: "inflight_limit {\n key {vars.user}\n limit {vars.k}\n retry_after 2\n}", key: "{vars.user}", limit: "{vars.k}", retry: 2},
		{in: "inflight_limit {user}", errPart: "no arguments or <key> <limit>"},
		{in: "inflight_limit {\n key {user}\n}", errPart: "needs a key and a limit"},
		{in: "inflight_limit {\n key {user}\n limit 2\n burst 3\n}", errPart: "unknown inflight_limit option"},
		{in: "inflight_limit {\n key {user}\n limit 2\n retry_after soon\n}", errPart: "retry_after"},
		{in: "inflight_limit {\n key {user} {other}\n limit 2\n}", errPart: "wrong argument count"},
	}
	for _, c := range cases {
		h := new(Handler)
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(c.in))
		if c.errPart != "" {
			if err == nil || !strings.Contains(err.Error(), c.errPart) {
				t.Errorf("%q: want an error with %q, got %v", c.in, c.errPart, err)
			}
			continue
		}
		if err != nil || h.Key != c.key || h.Limit != c.limit || h.RetryAfter != c.retry {
			t.Errorf("%q: got %+v, %v", c.in, h, err)
		}
	}
}

func TestProvisioningErrors(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for _, h := range []*Handler{
		{Key: "", Limit: "2"},
		{Key: "{user}", Limit: ""},
		{Key: "{user}", Limit: "0"},
		{Key: "{user}", Limit: "two"},
		{Key: "{user}", Limit: "2", RetryAfter: -1},
	} {
		if err := h.Provision(ctx); err == nil {
			t.Errorf("%+v: want a provisioning error", h)
		}
	}
}

// The directive adapts inside a real site block, in a route, before the handler it guards.
func TestCaddyfileAdapts(t *testing.T) {
	input := `:8080 {
	route {
		inflight_limit {
			key {http.request.header.X-User}
			limit 2
		}
		respond "ok"
	}
}`
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), nil)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), `"handler":"inflight_limit","key":"{http.request.header.X-User}","limit":"2"`) {
		t.Fatalf("adapted JSON lacks the handler: %s", out)
	}
}

// holdHandler is a test-only Caddy handler that holds each request until holdRelease is closed (a stream
// still running), so the next request of the same key meets a full bucket inside a real Caddy server.
type holdHandler struct{}

// The test that loads it makes both channels afresh, so it passes again under go test -count=N.
var holdStarted, holdRelease chan struct{}

func (holdHandler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.inflight_test_hold", New: func() caddy.Module { return new(holdHandler) }}
}

func (holdHandler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	w.WriteHeader(http.StatusOK)
	holdStarted <- struct{}{}
	select {
	case <-holdRelease:
	case <-r.Context().Done():
	}
	return nil
}

func init() { caddy.RegisterModule(holdHandler{}) }

// accessLogEntries returns the JSON access-log lines whose X-Request-Id header is id, polling (Caddy writes
// an entry when the handler chain returns, which may be after the client has the response).
func accessLogEntries(t *testing.T, path, id string) map[string]any {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		data, _ := os.ReadFile(path)
		for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
			var entry map[string]any
			if json.Unmarshal([]byte(line), &entry) != nil {
				continue
			}
			headers, _ := entry["request"].(map[string]any)["headers"].(map[string]any)
			if ids, _ := headers["X-Request-Id"].([]any); len(ids) == 1 && ids[0] == id {
				return entry
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no access-log entry for request %s in %q", id, data)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// In a real Caddy server, the concurrency refusal's access-log entry carries refused=concurrency_limit_exceeded
// (what log readers count per kind); an admitted request's entry has no such field.
func TestRefusalIsLabelledInTheAccessLog(t *testing.T) {
	holdStarted, holdRelease = make(chan struct{}, 16), make(chan struct{})
	dir := t.TempDir()
	t.Setenv("XDG_DATA_HOME", dir) // Caddy's instance id
	t.Setenv("XDG_CONFIG_HOME", dir)
	socket, logPath := filepath.Join(dir, "s.sock"), filepath.Join(dir, "access.log")
	config := fmt.Sprintf(`{
		"admin": {"disabled": true, "config": {"persist": false}},
		"storage": {"module": "file_system", "root": %q},
		"logging": {"logs": {"access": {
			"writer": {"output": "file", "filename": %q, "roll": false},
			"encoder": {"format": "json"}, "include": ["http.log.access.access"]}}},
		"apps": {"http": {"servers": {"gateway": {
			"listen": ["unix/%s"],
			"automatic_https": {"disable": true},
			"logs": {"default_logger_name": "access"},
			"routes": [{"handle": [
				{"handler": "inflight_limit", "key": "{http.request.header.X-User}", "limit": "1"},
				{"handler": "inflight_test_hold"}]}]}}}}}`, dir, logPath, socket)
	if err := caddy.Load([]byte(config), true); err != nil {
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", socket)
		}}}
	send := func(id string) int {
		req, _ := http.NewRequest(http.MethodPost, "http://gateway/v1/chat/completions", nil)
		req.Header.Set("X-User", "alice")
		req.Header.Set("X-Request-Id", id)
		resp, err := client.Do(req)
		if err != nil {
			t.Error(err)
			return 0
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode
	}

	held := make(chan int)
	go func() { held <- send("held") }() // admitted: holds alice's only slot until released
	<-holdStarted
	if code := send("refused"); code != http.StatusTooManyRequests {
		t.Fatalf("second request: %d, want 429", code)
	}
	close(holdRelease)
	if code := <-held; code != http.StatusOK {
		t.Fatalf("first request: %d, want 200", code)
	}

	if entry := accessLogEntries(t, logPath, "refused"); entry["refused"] != ErrorCode || entry["status"] != 429.0 {
		t.Fatalf("refused request's entry: refused=%v status=%v, want %q and 429", entry["refused"], entry["status"], ErrorCode)
	}
	if entry := accessLogEntries(t, logPath, "held"); entry["status"] != 200.0 {
		t.Fatalf("admitted request's entry: status=%v", entry["status"])
	} else if _, labelled := entry["refused"]; labelled {
		t.Fatalf("admitted request's entry is labelled refused: %v", entry)
	}
}

// Outside Caddy's HTTP server the request has no access-log fields: the refusal must still be answered.
func TestRefusalWithoutAccessLogFields(t *testing.T) {
	h := provisioned(t, "1")
	next := newBlockingNext()
	defer close(next.release)
	go func() { _ = h.ServeHTTP(httptest.NewRecorder(), request(context.Background(), "frida", ""), next) }()
	<-next.started
	for _, ctx := range []context.Context{
		context.Background(),
		context.WithValue(context.Background(), caddyhttp.ExtraLogFieldsCtxKey, (*caddyhttp.ExtraLogFields)(nil)),
	} {
		w := httptest.NewRecorder()
		if err := h.ServeHTTP(w, request(ctx, "frida", ""), next); err != nil || w.Code != http.StatusTooManyRequests {
			t.Fatalf("status %d, error %v; want 429 and none", w.Code, err)
		}
	}
}
