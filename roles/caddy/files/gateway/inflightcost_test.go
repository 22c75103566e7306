package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// provisionedCosted returns a handler keyed by {user} that counts each request's {cost}.
func provisionedCosted(t *testing.T, limit string) *Handler {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	h := &Handler{Key: "{user}", Limit: limit, Cost: "{cost}"}
	if err := h.Provision(ctx); err != nil {
		t.Fatalf("provision: %v", err)
	}
	t.Cleanup(func() {
		_ = h.Cleanup()
		cancel()
	})
	return h
}

// costed builds a request of user whose {cost} is cost (a Cost, as request_cost sets it, or a string).
func costed(ctx context.Context, user string, cost any) (*http.Request, *caddy.Replacer) {
	repl := caddy.NewReplacer()
	repl.Set("user", user)
	repl.Set("cost", cost)
	r := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
	return r.WithContext(context.WithValue(ctx, caddy.ReplacerCtxKey, repl)), repl
}

func seqs(n int) Cost { return Cost{Sequences: n, N: n, Prompts: 1} }

// admit sends a request of user with cost through h to a blocking next handler and reports whether it
// was admitted (and now held: release with next.release or ctx) or refused (its recorder).
func admit(t *testing.T, h *Handler, next *blockingNext, ctx context.Context, user string, cost any) (bool, *httptest.ResponseRecorder) {
	t.Helper()
	w := httptest.NewRecorder()
	r, _ := costed(ctx, user, cost)
	done := make(chan struct{})
	go func() {
		if err := h.ServeHTTP(w, r, next); err != nil {
			t.Errorf("ServeHTTP: %v", err)
		}
		close(done)
	}()
	select {
	case <-next.started:
		return true, nil
	case <-done:
		return false, w
	}
}

func errorOf(t *testing.T, w *httptest.ResponseRecorder) openAIErrorBody {
	t.Helper()
	var e openAIError
	if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil {
		t.Fatalf("body %q: %v", w.Body.String(), err)
	}
	return e.Error
}

// The user's sum of costs is capped: 3 + 1 fit a limit of 4, 3 + 2 do not (429), and the sum goes
// back to zero when they finish.
func TestCostSumIsCapped(t *testing.T) {
	h := provisionedCosted(t, "4")
	next := newBlockingNext()
	if ok, _ := admit(t, h, next, context.Background(), "alice", seqs(3)); !ok {
		t.Fatal("cost 3 of 4: refused")
	}
	ok, w := admit(t, h, next, context.Background(), "alice", seqs(2))
	if ok || w.Code != http.StatusTooManyRequests {
		t.Fatalf("3 + 2 of 4: admitted=%v", ok)
	}
	if e := errorOf(t, w); e.Code != ErrorCode || e.Type != "requests" || e.Param != nil ||
		!strings.Contains(e.Message, "limit 4): 3 in flight, and this request needs 2") || w.Header().Get("Retry-After") != "1" {
		t.Fatalf("429: %+v, Retry-After %q", e, w.Header().Get("Retry-After"))
	}
	if ok, _ := admit(t, h, next, context.Background(), "bob", seqs(4)); !ok {
		t.Fatal("bob's own sum is empty: his cost 4 of 4 must be admitted")
	}
	if ok, _ := admit(t, h, next, context.Background(), "alice", seqs(1)); !ok {
		t.Fatal("3 + 1 of 4: refused")
	}
	if n, keys := h.counters.inFlight("alice"); n != 4 || keys != 2 {
		t.Fatalf("alice in flight %d, keys %d; want 4 and 2", n, keys)
	}
	close(next.release)
	waitFor(t, func() bool { _, keys := h.counters.inFlight("alice"); return keys == 0 })
}

// waitFor polls cond for up to 5 seconds.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("condition not met in 5 s")
		}
	}
}

// A request costing more than the user's whole limit gets 400 naming the field, at once, even with
// nothing in flight: it could never be admitted.
func TestCostOverTheLimitIs400(t *testing.T) {
	h := provisionedCosted(t, "4")
	next := newBlockingNext()
	defer close(next.release)
	for _, tc := range []struct {
		cost          any
		param, phrase string
	}{
		{Cost{16, 2, 8, "prompt"}, "prompt", "This request asks for 16 sequences (n=2 × 8 prompts); your share of the engine is 4 sequences at once."},
		{Cost{8, 8, 1, ""}, "n", "This request asks for 8 sequences (n=8); your share of the engine is 4 sequences at once."},
		{Cost{8, 8, 1, "prompt"}, "n", "asks for 8 sequences (n=8);"},
		{Cost{16, 4, 4, "prompt"}, "n", "(n=4 × 4 prompts)"},
		{Cost{6, 1, 6, "input"}, "input", "asks for 6 sequences (6 inputs);"},
		{Cost{5, 1, 5, "prompt_embeds"}, "prompt_embeds", "(5 prompts)"},
		{"9", "", "This request asks for 9 sequences; your share"},
	} {
		ok, w := admit(t, h, next, context.Background(), "alice", tc.cost)
		if ok || w.Code != http.StatusBadRequest {
			t.Fatalf("%v: admitted=%v", tc.cost, ok)
		}
		e := errorOf(t, w)
		param := ""
		if e.Param != nil {
			param = *e.Param
		}
		if e.Code != TooManySequencesCode || e.Type != "invalid_request_error" || param != tc.param ||
			!strings.Contains(e.Message, tc.phrase) || w.Header().Get("Retry-After") != "" {
			t.Errorf("%v: %+v (param %q), Retry-After %q; want param %q and %q", tc.cost, e, param, w.Header().Get("Retry-After"), tc.param, tc.phrase)
		}
	}
	if _, keys := h.counters.inFlight("alice"); keys != 0 {
		t.Fatal("a refused request was counted")
	}
	// Exactly the limit is admitted.
	if ok, _ := admit(t, h, next, context.Background(), "alice", Cost{4, 2, 2, "prompt"}); !ok {
		t.Fatal("cost 4 of 4 refused")
	}
}

// Later handlers see the user's in-flight cost including the request, the limit and the cost.
func TestCostPlaceholdersForLaterHandlers(t *testing.T) {
	h := provisionedCosted(t, "8")
	next := newBlockingNext()
	defer close(next.release)
	if ok, _ := admit(t, h, next, context.Background(), "alice", seqs(2)); !ok {
		t.Fatal("refused")
	}
	r, repl := costed(context.Background(), "alice", Cost{3, 1, 3, "prompt"})
	var seen string
	err := h.ServeHTTP(httptest.NewRecorder(), r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		seen = repl.ReplaceAll("{inflight_limit.in_flight} {inflight_limit.limit} {inflight_limit.cost}", "?")
		return nil
	}))
	if err != nil || seen != "5 8 3" {
		t.Fatalf("placeholders %q (%v), want \"5 8 3\"", seen, err)
	}
}

// The cost is given back after completion, client disconnect, an upstream error and a panic.
func TestCostReleasedOnEveryEnd(t *testing.T) {
	h := provisionedCosted(t, "4")
	serve := func(ctx context.Context, next caddyhttp.Handler) (int, error) {
		w := httptest.NewRecorder()
		r, _ := costed(ctx, "bob", seqs(3))
		err := h.ServeHTTP(w, r, next)
		return w.Code, err
	}
	empty := func(after string) {
		t.Helper()
		if n, keys := h.counters.inFlight("bob"); n != 0 || keys != 0 {
			t.Fatalf("after %s: in flight %d, keys %d; want 0 and 0", after, n, keys)
		}
	}
	if code, err := serve(context.Background(), caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })); code != 200 || err != nil {
		t.Fatalf("completion: %d %v", code, err)
	}
	empty("completion")

	next := newBlockingNext()
	ctx, cancel := context.WithCancel(context.Background())
	finished := make(chan struct{})
	go func() { _, _ = serve(ctx, next); close(finished) }()
	<-next.started
	if n, _ := h.counters.inFlight("bob"); n != 3 {
		t.Fatalf("while streaming: in flight %d, want 3", n)
	}
	cancel()
	<-finished
	empty("client disconnect")

	upstream := caddyhttp.Error(http.StatusBadGateway, errors.New("dial tcp: connection refused"))
	if _, err := serve(context.Background(), caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return upstream })); !errors.Is(err, upstream) {
		t.Fatalf("the upstream error should propagate, got %v", err)
	}
	empty("an upstream error")

	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("the panic should propagate")
			}
		}()
		_, _ = serve(context.Background(), caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { panic("boom") }))
	}()
	empty("a panic")
}

// Across a graceful reload (new config provisioned, then the old one cleaned up), a request admitted
// under the old config keeps counting under the new one, and gives its cost back to the same sum.
func TestCostCountersSurviveAReload(t *testing.T) {
	old := provisionedCosted(t, "4")
	next := newBlockingNext()
	held := make(chan struct{})
	go func() {
		r, _ := costed(context.Background(), "erin", seqs(3))
		_ = old.ServeHTTP(httptest.NewRecorder(), r, next)
		close(held)
	}()
	<-next.started
	fresh := provisionedCosted(t, "4")
	_ = old.Cleanup()
	old.poolKey = ""
	if ok, w := admit(t, fresh, next, context.Background(), "erin", seqs(2)); ok || w.Code != http.StatusTooManyRequests {
		t.Fatalf("3 in flight under the old config + 2 under the new, limit 4: admitted=%v", ok)
	}
	close(next.release)
	<-held
	if n, keys := fresh.counters.inFlight("erin"); n != 0 || keys != 0 {
		t.Fatalf("after the old config's request ended: in flight %d, keys %d", n, keys)
	}
	r, _ := costed(context.Background(), "erin", seqs(4))
	w := httptest.NewRecorder()
	if err := fresh.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })); err != nil || w.Code != 200 {
		t.Fatalf("cost 4 under the new config: %d %v", w.Code, err)
	}
}

// Many users, random costs, at once: no user's sum ever passes the limit, and all sums end at zero.
func TestCostCapUnderConcurrency(t *testing.T) {
	const limit = 6
	h := provisionedCosted(t, "6")
	var wg sync.WaitGroup
	var admitted, refused atomic.Int64
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			for i := 0; i < 200; i++ {
				user := []string{"a", "b", "c"}[rng.IntN(3)]
				r, repl := costed(context.Background(), user, seqs(1+rng.IntN(limit)))
				w := httptest.NewRecorder()
				err := h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
					v, _ := repl.Get(InFlightPlaceholder)
					if n, _ := h.counters.inFlight(user); n > limit || v.(int) > limit {
						t.Errorf("%s has %d in flight (placeholder %v), limit %d", user, n, v, limit)
					}
					time.Sleep(time.Duration(rng.IntN(50)) * time.Microsecond)
					return nil
				}))
				if err != nil {
					t.Error(err)
				}
				if w.Code == http.StatusTooManyRequests {
					refused.Add(1)
				} else {
					admitted.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if _, keys := h.counters.inFlight("a"); keys != 0 || admitted.Load() == 0 {
		t.Fatalf("keys left %d, admitted %d, refused %d", keys, admitted.Load(), refused.Load())
	}
}

// A cost placeholder that gives no usable number is a configuration error: 500, nothing forwarded.
func TestUnusableCostFailsClosed(t *testing.T) {
	h := provisionedCosted(t, "4")
	for _, cost := range []any{"", "zero", "0", "-1", Cost{}, nil} {
		r, _ := costed(context.Background(), "dave", cost)
		err := h.ServeHTTP(httptest.NewRecorder(), r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
			t.Errorf("cost %v: forwarded", cost)
			return nil
		}))
		if statusOf(err) != http.StatusInternalServerError || !strings.Contains(err.Error(), "inflight_limit: cost") {
			t.Errorf("cost %#v: want a 500 naming the cost, got %v", cost, err)
		}
	}
	// Without the option every request costs 1, as before.
	plain := provisioned(t, "2")
	next := newBlockingNext()
	defer close(next.release)
	for i, want := range []bool{true, true, false} {
		if ok, _ := admit(t, plain, next, context.Background(), "dave", seqs(5)); ok != want {
			t.Fatalf("request %d without a cost option: admitted=%v", i, ok)
		}
	}
}

func TestCostCaddyfile(t *testing.T) {
	h := new(Handler)
	in := "inflight_limit {\n key {teamserve_user}\n limit {teamserve_max_inflight}\n cost {teamserve_cost}\n}"
	if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil || h.Cost != "{teamserve_cost}" {
		t.Fatalf("%+v, %v", h, err)
	}
	for in, errPart := range map[string]string{
		"inflight_limit {\n key {u}\n limit 2\n cost\n}":         "wrong argument count",
		"inflight_limit {\n key {u}\n limit 2\n cost {a} {b}\n}": "wrong argument count",
	} {
		if err := new(Handler).UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err == nil || !strings.Contains(err.Error(), errPart) {
			t.Errorf("%q: want an error with %q, got %v", in, errPart, err)
		}
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for _, cost := range []string{"0", "two"} {
		if err := (&Handler{Key: "{u}", Limit: "2", Cost: cost}).Provision(ctx); err == nil || !strings.Contains(err.Error(), "cost") {
			t.Errorf("cost %q: want a provisioning error, got %v", cost, err)
		}
	}
}
