package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/requestbody" // request_body, in the end-to-end configs
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	_ "github.com/caddyserver/caddy/v2/modules/filestorage" // storage in the test's own directory
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// fakeUpstream stands in for a reverseproxy.Upstream, whose request count and health only Caddy's own
// package can set.
type fakeUpstream struct {
	dial     string
	inFlight int
	down     bool
}

func (u *fakeUpstream) Available() bool  { return !u.down }
func (u *fakeUpstream) NumRequests() int { return u.inFlight }
func (u *fakeUpstream) String() string   { return u.dial }

// newCapacity provisions a policy with the given "dial cap" pairs and hash.
func newCapacity(t testing.TB, hash string, caps ...any) *CapacitySelection {
	t.Helper()
	s := &CapacitySelection{Hash: hash}
	for i := 0; i+1 < len(caps); i += 2 {
		s.Caps = append(s.Caps, UpstreamCap{Dial: caps[i].(string), Cap: caps[i+1].(int)})
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := s.Provision(ctx); err != nil {
		t.Fatalf("provision: %v", err)
	}
	return s
}

func fakes(dials ...string) []*fakeUpstream {
	pool := make([]*fakeUpstream, len(dials))
	for i, d := range dials {
		pool[i] = &fakeUpstream{dial: d}
	}
	return pool
}

// fill picks and counts a request on the chosen upstream until none is left (or 1,000 were placed: a
// cap not enforced); it returns the dials in the order chosen.
func fill(s *CapacitySelection, pool []*fakeUpstream, key string) []string {
	var order []string
	for len(order) < 1000 {
		i := pick(s, pool, key, nil)
		if i < 0 {
			break
		}
		pool[i].inFlight++
		order = append(order, pool[i].dial)
	}
	return order
}

// A 16-slot box takes two requests for each one an 8-slot box takes, all along, and neither gets one
// past its cap.
func TestCapacityWeightedSpread(t *testing.T) {
	s := newCapacity(t, "", "a:1", 8, "b:1", 16)
	pool := fakes("a:1", "b:1")
	order := fill(s, pool, "")
	if len(order) != 24 || pool[0].inFlight != 8 || pool[1].inFlight != 16 {
		t.Fatalf("chose %d times, a=%d b=%d; want 24, 8 and 16", len(order), pool[0].inFlight, pool[1].inFlight)
	}
	// The first is a tie at 0/8 and 0/16: the pool's order decides.
	if strings.Join(order[:6], " ") != "a:1 b:1 b:1 a:1 b:1 b:1" {
		t.Fatalf("first choices %v", order[:6])
	}
	a, b := 0, 0
	for i, d := range order {
		if d == "a:1" {
			a++
		} else {
			b++
		}
		// At every step the fractions a/8 and b/16 are at most one request of the smaller box apart.
		if diff := float64(a)/8 - float64(b)/16; diff > 1.0/8 || diff < -1.0/8 {
			t.Fatalf("after %d choices a=%d b=%d: not proportional", i+1, a, b)
		}
	}
}

// With three boxes of 4, 8 and 12 slots and requests finishing at random (fixed seed), the boxes'
// average load fractions stay close: the spread follows the caps under churn, not only when filling.
func TestCapacityWeightedSpreadUnderChurn(t *testing.T) {
	s := newCapacity(t, "", "a:1", 4, "b:1", 8, "c:1", 12)
	pool := fakes("a:1", "b:1", "c:1")
	caps := []int{4, 8, 12}
	sums := make([]float64, 3)
	seed := uint64(1)
	random := func(n int) int { seed = seed*6364136223846793005 + 1442695040888963407; return int(seed>>33) % n }
	const steps = 20000
	for step := 0; step < steps; step++ {
		if i := pick(s, pool, "", nil); i >= 0 {
			pool[i].inFlight++
		}
		// One request finishes somewhere, weighted by what is in flight.
		total := pool[0].inFlight + pool[1].inFlight + pool[2].inFlight
		if total > 0 {
			r := random(total)
			for _, u := range pool {
				if r < u.inFlight {
					u.inFlight--
					break
				}
				r -= u.inFlight
			}
		}
		for i, u := range pool {
			if u.inFlight > caps[i] {
				t.Fatalf("step %d: %s has %d in flight, cap %d", step, u.dial, u.inFlight, caps[i])
			}
			sums[i] += float64(u.inFlight) / float64(caps[i])
		}
	}
	for i := range sums {
		sums[i] /= steps
	}
	for i := 1; i < 3; i++ {
		if d := sums[i] - sums[0]; d > 0.1 || d < -0.1 {
			t.Fatalf("average load fractions %.3f; want them within 0.1 of each other", sums)
		}
	}
}

func TestCapacityLeastLoadFraction(t *testing.T) {
	s := newCapacity(t, "", "a:1", 8, "b:1", 16)
	pool := fakes("a:1", "b:1")
	for _, c := range []struct {
		a, b int
		want string
	}{
		{0, 0, "a:1"},  // tie: pool order
		{1, 0, "b:1"},  // 1/8 > 0/16
		{1, 2, "a:1"},  // 1/8 = 2/16: tie, pool order
		{1, 3, "a:1"},  // 1/8 < 3/16
		{4, 7, "b:1"},  // 4/8 > 7/16
		{3, 10, "a:1"}, // a box that finished requests takes the next one
	} {
		pool[0].inFlight, pool[1].inFlight = c.a, c.b
		if i := pick(s, pool, "", nil); i < 0 || pool[i].dial != c.want {
			t.Errorf("a=%d/8 b=%d/16: chose %d, want %s", c.a, c.b, i, c.want)
		}
	}
}

func TestCapacityFullAndUnavailableAreExcluded(t *testing.T) {
	s := newCapacity(t, "", "a:1", 8, "b:1", 16)
	pool := fakes("a:1", "b:1")

	// a is at its cap: b takes the request even at 15/16.
	pool[0].inFlight, pool[1].inFlight = 8, 15
	if i := pick(s, pool, "", nil); i != 1 {
		t.Fatalf("a full: chose %d, want b", i)
	}
	// Both at their caps: nothing.
	pool[1].inFlight = 16
	if i := pick(s, pool, "", nil); i != -1 {
		t.Fatalf("all full: chose %d, want none", i)
	}
	// a idle but unavailable (unhealthy, or at Caddy's own max_requests): b, while it has room.
	pool[0].inFlight, pool[0].down, pool[1].inFlight = 0, true, 12
	if i := pick(s, pool, "", nil); i != 1 {
		t.Fatalf("a down: chose %d, want b", i)
	}
	pool[1].down = true
	if i := pick(s, pool, "", nil); i != -1 {
		t.Fatalf("all down: chose %d, want none", i)
	}
	if i := pick(s, []*fakeUpstream{}, "", nil); i != -1 {
		t.Fatalf("empty pool: chose %d", i)
	}
}

// An upstream without a cap line is never excluded by the policy, weighs as the largest cap, and is
// logged once.
func TestCapacityUncappedUpstream(t *testing.T) {
	s := newCapacity(t, "", "a:1", 4, "b:1", 8)
	core, logs := observer.New(zap.WarnLevel)
	s.logger = zap.New(core)
	pool := fakes("a:1", "b:1", "c:1")
	pool[0].inFlight, pool[1].inFlight, pool[2].inFlight = 1, 2, 3 // 1/4 < 3/8 = c's 3 of the largest cap, 8
	if i := pick(s, pool, "", nil); i != 0 {
		t.Fatalf("chose %d, want a", i)
	}
	pool[0].inFlight = 2 // 2/4 > 3/8 = 3/8 (b and c tie: pool order)
	if i := pick(s, pool, "", nil); i != 1 {
		t.Fatalf("chose %d, want b", i)
	}
	pool[0].inFlight, pool[1].inFlight, pool[2].inFlight = 4, 8, 50
	if i := pick(s, pool, "", nil); i != 2 {
		t.Fatalf("a and b full: chose %d, want the uncapped c", i)
	}
	if n := logs.FilterField(zap.String("dial", "c:1")).Len(); n != 1 || logs.Len() != 1 {
		t.Fatalf("want one warning naming c:1, got %d (%d in all)", n, logs.Len())
	}
}

// homes returns each key's choice in pool.
func homes(s *CapacitySelection, pool []*fakeUpstream, keys []string) map[string]string {
	out := make(map[string]string, len(keys))
	for _, k := range keys {
		if i := pick(s, pool, k, nil); i >= 0 {
			out[k] = pool[i].dial
		} else {
			out[k] = ""
		}
	}
	return out
}

func userKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("user-%d", i)
	}
	return keys
}

// A key stays on its box whatever the other boxes' loads, as long as its box has room.
func TestCapacityHashIsSticky(t *testing.T) {
	s := newCapacity(t, "{user}", "a:1", 8, "b:1", 8, "c:1", 8)
	pool := fakes("a:1", "b:1", "c:1")
	for _, key := range userKeys(50) {
		home := pick(s, pool, key, nil)
		for load := 0; load < 8; load++ {
			pool[home].inFlight = load // the sticky box busier than the idle others
			if i := pick(s, pool, key, nil); i != home {
				t.Fatalf("%s at load %d: moved from %d to %d", key, load, home, i)
			}
		}
		pool[home].inFlight = 0
	}
}

// When a key's box is full, down or removed, only the keys of that box move; when it has room again,
// they come back.
func TestCapacityHashMovesOnlyTheLeavingBoxKeys(t *testing.T) {
	s := newCapacity(t, "{user}", "a:1", 8, "b:1", 8, "c:1", 8, "d:1", 8)
	pool := fakes("a:1", "b:1", "c:1", "d:1")
	keys := userKeys(4000)
	before := homes(s, pool, keys)

	check := func(what string, after map[string]string) {
		t.Helper()
		moved := 0
		for _, k := range keys {
			switch {
			case before[k] == "b:1" && (after[k] == "b:1" || after[k] == ""):
				t.Fatalf("%s: %s stayed on b or found nothing: %q", what, k, after[k])
			case before[k] == "b:1":
				moved++
			case after[k] != before[k]:
				t.Fatalf("%s: %s moved from %s to %s though its box has room", what, k, before[k], after[k])
			}
		}
		if moved == 0 {
			t.Fatalf("%s: no key was on b", what)
		}
	}

	pool[1].inFlight = 8
	full := homes(s, pool, keys)
	check("b full", full)
	pool[1].inFlight, pool[1].down = 0, true
	down := homes(s, pool, keys)
	check("b down", down)
	check("b removed", homes(s, []*fakeUpstream{pool[0], pool[2], pool[3]}, keys))
	// Each displaced key has one second choice, whatever made its box leave.
	for _, k := range keys {
		if full[k] != down[k] {
			t.Fatalf("%s: second choice %s when b is full, %s when b is down", k, full[k], down[k])
		}
	}

	pool[1].down = false
	back := homes(s, pool, keys)
	for _, k := range keys {
		if back[k] != before[k] {
			t.Fatalf("b back: %s on %s, was on %s", k, back[k], before[k])
		}
	}

	// A new box takes keys only from the others, a share in proportion to its cap.
	grown := append(fakes("e:1"), pool...)
	s = newCapacity(t, "{user}", "a:1", 8, "b:1", 8, "c:1", 8, "d:1", 8, "e:1", 8)
	gained := 0
	for k, home := range homes(s, grown, keys) {
		if home == "e:1" {
			gained++
		} else if home != before[k] {
			t.Fatalf("adding e moved %s from %s to %s", k, before[k], home)
		}
	}
	if share := float64(gained) / float64(len(keys)); share < 0.17 || share > 0.23 {
		t.Fatalf("e took %.3f of the keys, want about 1/5", share)
	}
}

// Keys spread over the boxes in proportion to their caps.
func TestCapacityHashSpreadFollowsCaps(t *testing.T) {
	s := newCapacity(t, "{user}", "a:1", 8, "b:1", 16, "c:1", 8)
	pool := fakes("a:1", "b:1", "c:1")
	keys := userKeys(20000)
	count := map[string]int{}
	for _, home := range homes(s, pool, keys) {
		count[home]++
	}
	for dial, want := range map[string]float64{"a:1": 0.25, "b:1": 0.5, "c:1": 0.25} {
		if got := float64(count[dial]) / float64(len(keys)); got < want-0.02 || got > want+0.02 {
			t.Errorf("%s has %.3f of the keys, want %.2f", dial, got, want)
		}
	}
}

func TestCapacityHashWhenEveryBoxIsFull(t *testing.T) {
	s := newCapacity(t, "{user}", "a:1", 1, "b:1", 1)
	pool := fakes("a:1", "b:1")
	if order := fill(s, pool, "alice"); len(order) != 2 || order[0] == order[1] {
		t.Fatalf("alice filled %v, want her box then the other", order)
	}
	if i := pick(s, pool, "bob", nil); i != -1 {
		t.Fatalf("all full: bob got %d", i)
	}
}

// The hash is FNV-1a of key, a 0 byte and the dial address, then the finalizer: fixed, so front
// gateways (and every reload) agree on each key's box. Changing it moves every user's prefix cache.
func TestCapacityHashIsStable(t *testing.T) {
	for _, c := range [][2]string{{"alice", "10.0.0.1:8443"}, {"", "b:1"}, {"bob", "[fd00::1]:8443"}} {
		f := fnv.New64a()
		_, _ = io.WriteString(f, c[0]+"\x00"+c[1])
		if got, want := rendezvousHash(fnv1a(fnvOffset, c[0]), c[1]), mix64(f.Sum64()); got != want {
			t.Errorf("%q: %x, want %x", c, got, want)
		}
	}
	// MurmurHash3's fmix64 test values.
	if mix64(0) != 0 || mix64(1) != 0xb456bcfc34c2cb2c {
		t.Errorf("mix64(1) = %x", mix64(1))
	}
	// Equal weights rank the boxes as the hash does.
	k := fnv1a(fnvOffset, "carol")
	if (rendezvousScore(k, "a:1", 8) > rendezvousScore(k, "b:1", 8)) != (rendezvousHash(k, "a:1") > rendezvousHash(k, "b:1")) {
		t.Error("equal weights must order the upstreams by hash")
	}
}

// withKey returns a request whose replacer has {user} = user.
func withKey(user string) *http.Request {
	repl := caddy.NewReplacer()
	repl.Set("user", user)
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	return r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
}

// Select on Caddy's own upstreams: the key comes from the request's placeholders; an empty key, or no
// hash configured, is least load (all idle here: the first).
func TestCapacitySelectOnRealUpstreams(t *testing.T) {
	dials := []string{"10.0.0.1:8443", "10.0.0.2:8443", "10.0.0.3:8443"}
	var pool reverseproxy.UpstreamPool
	for _, d := range dials {
		pool = append(pool, &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: d})
	}
	hashed := newCapacity(t, "{user}", dials[0], 8, dials[1], 16, dials[2], 8)
	plain := newCapacity(t, "", dials[0], 8, dials[1], 16, dials[2], 8)
	if got := plain.Select(pool, withKey("alice"), nil); got != pool[0] {
		t.Fatalf("no hash: got %v, want the first", got)
	}
	if got := hashed.Select(pool, withKey(""), nil); got != pool[0] {
		t.Fatalf("empty key: got %v, want the first", got)
	}
	if got := hashed.Select(pool, httptest.NewRequest(http.MethodGet, "/", nil), nil); got != pool[0] {
		t.Fatalf("no replacer: got %v, want the first", got)
	}
	spread := map[string]bool{}
	for _, user := range userKeys(40) {
		got := hashed.Select(pool, withKey(user), nil)
		want := pick(hashed, fakes(dials...), user, nil)
		if got == nil || got != pool[want] {
			t.Fatalf("%s: got %v, want %s", user, got, dials[want])
		}
		spread[got.Dial] = true
	}
	if len(spread) != 3 {
		t.Fatalf("40 users went to %d boxes", len(spread))
	}
	if got := hashed.Select(nil, withKey("alice"), nil); got != nil {
		t.Fatalf("empty pool: got %v", got)
	}
}

// Selections run concurrently on one provisioned policy (go test -race).
func TestCapacityConcurrentSelect(t *testing.T) {
	s := newCapacity(t, "{user}", "10.0.0.1:8443", 8)
	pool := reverseproxy.UpstreamPool{
		{Host: new(reverseproxy.Host), Dial: "10.0.0.1:8443"},
		{Host: new(reverseproxy.Host), Dial: "10.0.0.9:8443"}, // uncapped: the warning's map is shared
	}
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 500; i++ {
				if s.Select(pool, withKey(fmt.Sprintf("user-%d", i%7)), nil) == nil {
					t.Error("no upstream chosen")
					return
				}
			}
		}()
	}
	wg.Wait()
}

func TestCapacityValidationNamesTheValue(t *testing.T) {
	cases := []struct {
		s       *CapacitySelection
		errPart string
	}{
		{&CapacitySelection{}, "at least one cap"},
		{&CapacitySelection{Caps: []UpstreamCap{{"10.0.0.1:8443", 0}}}, "cap 10.0.0.1:8443 0: the in-flight cap must be >= 1"},
		{&CapacitySelection{Caps: []UpstreamCap{{"10.0.0.1:8443", -3}}}, "cap 10.0.0.1:8443 -3"},
		{&CapacitySelection{Caps: []UpstreamCap{{"10.0.0.1:8443", 8}, {"10.0.0.1:8443", 16}}}, "cap 10.0.0.1:8443 given twice"},
		{&CapacitySelection{Caps: []UpstreamCap{{"https://10.0.0.1:8443", 8}}}, `cap "https://10.0.0.1:8443": want the upstream's dial address host:port, not a URL`},
		{&CapacitySelection{Caps: []UpstreamCap{{"10.0.0.1", 8}}}, `cap "10.0.0.1": want host:port`},
		{&CapacitySelection{Caps: []UpstreamCap{{"10.0.0.1:http", 8}}}, `port "http" is not a number`},
		{&CapacitySelection{Caps: []UpstreamCap{{"10.0.0.1:0", 8}}}, `port "0"`},
		{&CapacitySelection{Caps: []UpstreamCap{{":8443", 8}}}, `cap ":8443": want host:port: missing host`},
		{&CapacitySelection{Caps: []UpstreamCap{{"", 8}}}, "empty dial address"},
		{&CapacitySelection{Caps: []UpstreamCap{{"a b:1", 8}}}, `cap "a b:1": a dial address has no spaces`},
		{&CapacitySelection{Caps: []UpstreamCap{{"unix/", 8}}}, "unix socket without a path"},
		{&CapacitySelection{Caps: []UpstreamCap{{"fd00::1:8443", 8}}}, `cap "fd00::1:8443": want host:port`},
		{&CapacitySelection{Caps: []UpstreamCap{{"a:1", 8}}, Hash: "  "}, "hash \"  \" is blank"},
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for _, c := range cases {
		err := c.s.Provision(ctx)
		if err == nil || !strings.Contains(err.Error(), c.errPart) {
			t.Errorf("%+v: want an error with %q, got %v", c.s.Caps, c.errPart, err)
		}
	}
	for _, dial := range []string{"10.0.0.1:8443", "[fd00::1]:8443", "box-a.example:443", "unix//run/engine.sock"} {
		s := &CapacitySelection{Caps: []UpstreamCap{{dial, 1}}}
		if err := s.Provision(ctx); err != nil {
			t.Errorf("%s: %v", dial, err)
		}
	}
}

func TestCapacityCaddyfile(t *testing.T) {
	in := `capacity {
		cap 10.0.0.1:8443 8      # a comment
		cap [fd00::2]:8443 16
		hash {teamserve_user}
	}`
	s := new(CapacitySelection)
	if err := s.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(s.Caps) != "[{10.0.0.1:8443 8} {[fd00::2]:8443 16}]" || s.Hash != "{teamserve_user}" {
		t.Fatalf("parsed %+v", s)
	}
	for in, errPart := range map[string]string{
		"capacity least":                                  `takes no arguments (caps go in its block), got "least"`,
		"capacity {\n}":                                   "needs at least one cap",
		"capacity {\n cap 10.0.0.1:8443\n}":               "cap needs <dial address> <max in flight>, got 1 values",
		"capacity {\n cap 10.0.0.1:8443 8 9\n}":           "got 3 values",
		"capacity {\n cap 10.0.0.1:8443 eight\n}":         `cap 10.0.0.1:8443 "eight": the in-flight cap must be a whole number >= 1`,
		"capacity {\n cap 10.0.0.1:8443 0\n}":             `cap 10.0.0.1:8443 "0"`,
		"capacity {\n cap https://10.0.0.1:8443 8\n}":     `cap "https://10.0.0.1:8443": want the upstream's dial address`,
		"capacity {\n cap a:1 8\n cap a:1 4\n}":           "cap a:1 given twice",
		"capacity {\n cap a:1 8\n hash\n}":                "hash needs one value",
		"capacity {\n cap a:1 8\n hash {a} {b}\n}":        "hash needs one value",
		"capacity {\n cap a:1 8\n hash {a}\n hash {b}\n}": "hash given twice",
		"capacity {\n cap a:1 8\n weight a:1 2\n}":        `unknown lb_policy capacity option "weight"`,
	} {
		if err := new(CapacitySelection).UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err == nil ||
			!strings.Contains(err.Error(), errPart) {
			t.Errorf("%q: want an error with %q, got %v", in, errPart, err)
		}
	}
}

// findKey returns the first value named key in decoded JSON, depth first.
func findKey(v any, key string) any {
	switch v := v.(type) {
	case map[string]any:
		if found, ok := v[key]; ok {
			return found
		}
		for _, child := range v {
			if found := findKey(child, key); found != nil {
				return found
			}
		}
	case []any:
		for _, child := range v {
			if found := findKey(child, key); found != nil {
				return found
			}
		}
	}
	return nil
}

// The Caddyfile form, in a reverse_proxy of a real site block, adapts to the policy's JSON.
func TestCapacityCaddyfileAdapts(t *testing.T) {
	input := `:8080 {
	reverse_proxy https://10.0.0.1:8443 https://10.0.0.2:8443 {
		lb_policy capacity {
			cap 10.0.0.1:8443 8
			cap 10.0.0.2:8443 16
			hash {teamserve_user}
		}
	}
}`
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), nil)
	if err != nil {
		t.Fatal(err)
	}
	var config any
	if err := json.Unmarshal(out, &config); err != nil {
		t.Fatal(err)
	}
	policy, _ := json.Marshal(findKey(config, "selection_policy"))
	want := `{"caps":[{"cap":8,"dial":"10.0.0.1:8443"},{"cap":16,"dial":"10.0.0.2:8443"}],"hash":"{teamserve_user}","policy":"capacity"}`
	if string(policy) != want {
		t.Fatalf("selection_policy %s, want %s\nin %s", policy, want, out)
	}
	// The dial addresses Caddy gives the upstreams are the ones the caps name.
	upstreams, _ := json.Marshal(findKey(config, "upstreams"))
	if string(upstreams) != `[{"dial":"10.0.0.1:8443"},{"dial":"10.0.0.2:8443"}]` {
		t.Fatalf("upstreams %s", upstreams)
	}
}

// caddyClient loads a Caddyfile (its site listens on the unix socket {socket}) into a running Caddy and
// returns a client for it; Caddy is stopped when the test ends.
func caddyClient(t *testing.T, caddyfileText string) *http.Client {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("XDG_DATA_HOME", dir) // Caddy's instance id
	t.Setenv("XDG_CONFIG_HOME", dir)
	socket := filepath.Join(dir, "s.sock")
	caddyfileText = strings.ReplaceAll(caddyfileText, "{socket}", socket)
	caddyfileText = "{\n\tadmin off\n\tpersist_config off\n\tstorage file_system " + dir + "\n}\n" + caddyfileText
	config, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfileText), nil)
	if err != nil {
		t.Fatalf("adapt: %v", err)
	}
	for _, w := range warnings {
		t.Logf("adapt warning: %s", w)
	}
	if err := caddy.Load(config, true); err != nil {
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", socket)
		}}}
}

// holdingBackend answers each request once release is closed, and reports its arrival first.
type holdingBackend struct {
	*httptest.Server
	arrived chan struct{}
	release chan struct{}
}

func newHoldingBackend(t *testing.T) *holdingBackend {
	b := &holdingBackend{arrived: make(chan struct{}, 16), release: make(chan struct{})}
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.arrived <- struct{}{}
		select {
		case <-b.release:
		case <-r.Context().Done():
		}
		_, _ = io.WriteString(w, b.Listener.Addr().String())
	}))
	t.Cleanup(b.Close)
	return b
}

// End to end in Caddy: the policy sees reverse_proxy's real in-flight counts, fills the 1-slot and the
// 2-slot box, and with both full Caddy answers 503 without reaching either.
func TestCapacityInCaddy(t *testing.T) {
	small, large := newHoldingBackend(t), newHoldingBackend(t)
	smallDial, largeDial := small.Listener.Addr().String(), large.Listener.Addr().String()
	client := caddyClient(t, fmt.Sprintf(`http:// {
	bind unix/{socket}
	reverse_proxy %[1]s %[2]s {
		lb_policy capacity {
			cap %[1]s 1
			cap %[2]s 2
		}
	}
}`, smallDial, largeDial))
	type result struct {
		status int
		body   string
	}
	send := func() result {
		resp, err := client.Get("http://gateway/v1/models")
		if err != nil {
			return result{0, err.Error()}
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return result{resp.StatusCode, string(body)}
	}
	results := make(chan result, 3)
	// One at a time, each held at its backend before the next is sent: the counts are then exact.
	for _, b := range []*holdingBackend{small, large, large} {
		go func() { results <- send() }()
		select {
		case <-b.arrived:
		case <-time.After(5 * time.Second):
			t.Fatalf("a request did not reach %s", b.Listener.Addr())
		}
	}
	if got := send(); got.status != http.StatusServiceUnavailable {
		t.Fatalf("with both boxes full: %d %q, want 503", got.status, got.body)
	}
	close(small.release)
	close(large.release)
	bodies := map[string]int{}
	for i := 0; i < 3; i++ {
		got := <-results
		if got.status != http.StatusOK {
			t.Fatalf("held request: %d %q", got.status, got.body)
		}
		bodies[got.body]++
	}
	if bodies[smallDial] != 1 || bodies[largeDial] != 2 {
		t.Fatalf("answers %v, want 1 from %s and 2 from %s", bodies, smallDial, largeDial)
	}
	if len(small.arrived)+len(large.arrived) != 0 {
		t.Fatal("the refused request reached a backend")
	}
}
