package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// engineDouble stands in for vLLM: it records the priority each request's body and X-Vllm-Priority
// header carry, holds a request marked X-Test-Hold until release is closed (a stream in progress) or
// the client goes, and drops one marked X-Test-Abort (an engine crash: Caddy answers 502).
type engineDouble struct {
	*httptest.Server
	seen    chan engineSaw
	release chan struct{}
}

type engineSaw struct {
	path, priority, header, body string
}

func newEngineDouble(t *testing.T) *engineDouble {
	e := &engineDouble{seen: make(chan engineSaw, 64), release: make(chan struct{})}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var doc map[string]any
		d := json.NewDecoder(bytes.NewReader(body))
		d.UseNumber()
		priority := "<none>"
		if d.Decode(&doc) == nil {
			if p, ok := doc["priority"]; ok {
				priority = fmt.Sprint(p)
			}
		}
		e.seen <- engineSaw{r.URL.Path, priority, r.Header.Get("X-Vllm-Priority"), string(body)}
		if r.Header.Get("X-Test-Abort") != "" {
			panic(http.ErrAbortHandler)
		}
		if r.Header.Get("X-Test-Hold") != "" {
			select {
			case <-e.release:
			case <-r.Context().Done():
			}
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"object":"chat.completion"}`)
	}))
	t.Cleanup(e.Close)
	return e
}

// next returns what the engine saw for the next request that reached it.
func (e *engineDouble) next(t *testing.T) engineSaw {
	t.Helper()
	select {
	case s := <-e.seen:
		return s
	case <-time.After(5 * time.Second):
		t.Fatal("no request reached the engine")
		return engineSaw{}
	}
}

// gatewayCaddyfile is the gateway's chain as the caddy role's template should write it: api_key_map
// (user, in-flight cap in sequences, lane), then in the route request_cost, inflight_limit counting
// cost, request_priority, reverse_proxy. Alice and bob have 4 sequences at once; carol is the batch
// lane. The fair share is 2 sequences.
func gatewayCaddyfile(engine, logPath, marker string) string {
	return fmt.Sprintf(`http:// {
	bind unix/{socket}
	log {
		output file %[2]s
		format json
	}
	api_key_map {teamserve_user} {teamserve_max_inflight} {teamserve_lane} {
		%[3]s alice 4 interactive
		%[4]s bob 4 interactive
		%[5]s carol 4 batch
		default "" 1 ""
	}
	request_body {
		max_size 1000000
	}
	route {
		respond /marker "%[6]s"
		request_cost {teamserve_cost}
		inflight_limit {
			key {teamserve_user}
			limit {teamserve_max_inflight}
			cost {teamserve_cost}
		}
		request_priority {
			share 2
			lane {teamserve_lane}
		}
		reverse_proxy %[1]s
	}
}`, engine, logPath, sum(aliceKey), sum(bobKey), sum(carolKey), marker)
}

const carolKey = "k3yForCarolWith48RandomCharactersZZZZZZZZZZZZZZZZ"

// gateway runs caddyfileText (its site listens on {socket}) in an in-process Caddy and returns a
// client for it (no keep-alive, so that after a reload each request reaches the running config) and a
// function that loads another Caddyfile in its place, as a graceful reload does.
func gateway(t *testing.T, caddyfileText string) (*http.Client, func(string) error) {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("XDG_DATA_HOME", dir)
	t.Setenv("XDG_CONFIG_HOME", dir)
	socket := filepath.Join(dir, "s.sock")
	load := func(text string) error {
		text = "{\n\tadmin off\n\tpersist_config off\n\tstorage file_system " + dir + "\n}\n" +
			strings.ReplaceAll(text, "{socket}", socket)
		config, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(text), nil)
		if err != nil {
			return fmt.Errorf("adapt: %v", err)
		}
		return caddy.Load(config, true)
	}
	if err := load(caddyfileText); err != nil {
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", socket)
		}}}, load
}

type answer struct {
	status int
	body   string
}

// post sends body to path as the holder of key; headers are name, value pairs (X-Test-Hold...).
func post(ctx context.Context, client *http.Client, key, path, body string, headers ...string) answer {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://gateway"+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		return answer{0, err.Error()}
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, string(out)}
}

func openAIErrorOf(t *testing.T, a answer) openAIErrorBody {
	t.Helper()
	var e openAIError
	if err := json.Unmarshal([]byte(a.body), &e); err != nil {
		t.Fatalf("answer %d %q: %v", a.status, a.body, err)
	}
	return e.Error
}

// allCountersEmpty reports whether every inflight_limit sum in the process is back to zero.
func allCountersEmpty() bool {
	empty := true
	pool.Range(func(_, value any) bool {
		c := value.(*counters)
		c.mu.Lock()
		empty = empty && len(c.byKey) == 0
		c.mu.Unlock()
		return empty
	})
	return empty
}

// End to end in Caddy, from a Caddyfile: a request costing more than its user's share is refused
// with 400 while the other user's requests are admitted; the engine sees the gateway's priority and
// never the client's; counts return to zero after completion, client disconnect and an engine crash.
func TestCostAndPriorityInCaddy(t *testing.T) {
	engine := newEngineDouble(t)
	logPath := filepath.Join(t.TempDir(), "access.log")
	client, _ := gateway(t, gatewayCaddyfile(engine.Listener.Addr().String(), logPath, "v1"))
	ctx := context.Background()
	chat := func(n int, priority string) string {
		return fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"hi"}],"n":%d,"priority":%s}`, n, priority)
	}

	// Alice asks for 8 sequences at once (8 prompts), and then n=8: more than her 4, so 400, at once.
	eight := `{"model":"m","prompt":["a","b","c","d","e","f","g","h"],"max_tokens":4}`
	a := post(ctx, client, aliceKey, "/v1/completions", eight, "X-Request-Id", "alice-8-prompts")
	e := openAIErrorOf(t, a)
	if a.status != http.StatusBadRequest || e.Code != TooManySequencesCode || e.Param == nil || *e.Param != "prompt" ||
		!strings.Contains(e.Message, "This request asks for 8 sequences (8 prompts); your share of the engine is 4 sequences at once.") {
		t.Fatalf("alice, 8 prompts: %d %s", a.status, a.body)
	}
	a = post(ctx, client, aliceKey, "/v1/chat/completions", chat(8, "0"))
	if e := openAIErrorOf(t, a); a.status != http.StatusBadRequest || e.Param == nil || *e.Param != "n" || !strings.Contains(e.Message, "(n=8)") {
		t.Fatalf("alice, n=8: %d %s", a.status, a.body)
	}
	a = post(ctx, client, aliceKey, "/v1/chat/completions", `{"messages":[],"n":"2"}`, "X-Request-Id", "alice-bad-n")
	if e := openAIErrorOf(t, a); a.status != http.StatusBadRequest || e.Code != CodeInvalidType || *e.Param != "n" {
		t.Fatalf("alice, n \"2\": %d %s", a.status, a.body)
	}
	select {
	case s := <-engine.seen:
		t.Fatalf("a refused request reached the engine: %+v", s)
	default:
	}

	// Bob: n=2 (within his share of 2: priority 0, whatever he sent), then 2 prompts (4 in flight, 2
	// over: priority 2), both held like streams; then a third is over his 4: 429.
	held := make(chan answer, 4)
	streamCtx, disconnect := context.WithCancel(ctx)
	go func() {
		held <- post(streamCtx, client, bobKey, "/v1/chat/completions", chat(2, "-100"), "X-Test-Hold", "1")
	}()
	if s := engine.next(t); s.priority != "0" || s.header != "0" || !strings.Contains(s.body, `"n":2,"priority":0}`) {
		t.Fatalf("bob's first: the engine saw %+v", s)
	}
	go func() {
		held <- post(ctx, client, bobKey, "/v1/completions", `{"priority":0,"prompt":["a","b"]}`, "X-Test-Hold", "1")
	}()
	if s := engine.next(t); s.priority != "2" || s.header != "2" || s.body != `{"priority":2,"prompt":["a","b"]}` {
		t.Fatalf("bob's second: the engine saw %+v", s)
	}
	a = post(ctx, client, bobKey, "/v1/chat/completions", chat(1, "0"), "X-Request-Id", "bob-429")
	if e := openAIErrorOf(t, a); a.status != http.StatusTooManyRequests || e.Code != ErrorCode {
		t.Fatalf("bob's third: %d %s", a.status, a.body)
	}

	// Alice is admitted while bob is full, at priority 0; carol's batch lane is always last.
	if a := post(ctx, client, aliceKey, "/v1/chat/completions", chat(1, "-5"), "X-Vllm-Priority", "-1000"); a.status != http.StatusOK {
		t.Fatalf("alice while bob is full: %d %s", a.status, a.body)
	}
	if s := engine.next(t); s.priority != "0" || s.header != "0" {
		t.Fatalf("alice: the engine saw %+v", s)
	}
	if a := post(ctx, client, carolKey, "/v1/embeddings", `{"input":"x","priority":-100}`); a.status != http.StatusOK {
		t.Fatalf("carol: %d %s", a.status, a.body)
	}
	if s := engine.next(t); s.priority != "10" || s.path != "/v1/embeddings" {
		t.Fatalf("carol: the engine saw %+v", s)
	}

	// Bob's first client hangs up: his 2 come back, and 2 more fit again.
	disconnect()
	if a := <-held; a.status != 0 {
		t.Fatalf("the disconnected request: %+v", a)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		a = post(ctx, client, bobKey, "/v1/chat/completions", chat(2, "0"))
		if a.status == http.StatusOK {
			break
		}
		if a.status != http.StatusTooManyRequests || time.Now().After(deadline) {
			t.Fatalf("after bob's disconnect: %d %s", a.status, a.body)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if s := engine.next(t); s.priority != "2" {
		t.Fatalf("bob with 2 + 2 in flight: the engine saw %+v", s)
	}

	// The engine drops a request: 502, and the cost comes back.
	if a := post(ctx, client, bobKey, "/v1/chat/completions", chat(2, "0"), "X-Test-Abort", "1"); a.status != http.StatusBadGateway {
		t.Fatalf("engine crash: %d %s", a.status, a.body)
	}
	engine.next(t)

	close(engine.release)
	if a := <-held; a.status != http.StatusOK {
		t.Fatalf("bob's held request: %d %s", a.status, a.body)
	}
	deadline = time.Now().Add(5 * time.Second)
	for !allCountersEmpty() {
		if time.Now().After(deadline) {
			t.Fatal("in-flight sums not back to zero")
		}
		time.Sleep(10 * time.Millisecond)
	}

	// The refusals are labelled in the access log by kind.
	for id, want := range map[string]string{"alice-8-prompts": TooManySequencesCode, "alice-bad-n": CodeInvalidType, "bob-429": ErrorCode} {
		if entry := accessLogEntries(t, logPath, id); entry["refused"] != want {
			t.Errorf("%s: refused=%v, want %s", id, entry["refused"], want)
		}
	}
}

// Across a real graceful reload: a request admitted under the old config keeps its cost counted under
// the new one, and gives it back when it ends.
func TestCostCountsSurviveACaddyReload(t *testing.T) {
	engine := newEngineDouble(t)
	logPath := filepath.Join(t.TempDir(), "access.log")
	client, load := gateway(t, gatewayCaddyfile(engine.Listener.Addr().String(), logPath, "v1"))
	ctx := context.Background()
	held := make(chan answer, 1)
	go func() {
		held <- post(ctx, client, bobKey, "/v1/completions", `{"prompt":["a","b","c"]}`, "X-Test-Hold", "1")
	}()
	engine.next(t)

	reloaded := make(chan error, 1)
	go func() { reloaded <- load(gatewayCaddyfile(engine.Listener.Addr().String(), logPath, "v2")) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		req, _ := http.NewRequest(http.MethodPost, "http://gateway/marker", nil)
		req.Header.Set("Authorization", "Bearer "+bobKey)
		if resp, err := client.Do(req); err == nil {
			body, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if string(body) == "v2" {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the new config never answered")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if a := post(ctx, client, bobKey, "/v1/completions", `{"prompt":["a","b"]}`); a.status != http.StatusTooManyRequests {
		t.Fatalf("3 in flight from the old config + 2, limit 4: %d %s", a.status, a.body)
	}
	close(engine.release)
	if a := <-held; a.status != http.StatusOK {
		t.Fatalf("the old config's request: %d %s", a.status, a.body)
	}
	if err := <-reloaded; err != nil {
		t.Fatalf("reload: %v", err)
	}
	if a := post(ctx, client, bobKey, "/v1/completions", `{"prompt":["a","b","c","d"]}`); a.status != http.StatusOK {
		t.Fatalf("4 of 4 after the old request ended: %d %s", a.status, a.body)
	}
	engine.next(t)
	deadline = time.Now().Add(5 * time.Second)
	for !allCountersEmpty() {
		if time.Now().After(deadline) {
			t.Fatal("in-flight sums not back to zero after the reload")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
