package gateway

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

const (
	aliceKey = "k3yForAliceWith48RandomCharactersXXXXXXXXXXXXXXXX"
	bobKey   = "k3yForBobWith48RandomCharactersYYYYYYYYYYYYYYYYYY"
)

func sum(key string) string {
	s := sha256.Sum256([]byte(key))
	return hex.EncodeToString(s[:])
}

// userMap is the gateway's shape: user, expiry, in-flight cap, rate tier.
func userMap(t *testing.T) *KeyMap {
	t.Helper()
	m := &KeyMap{
		Destinations: []string{"{user}", "{expires}", "{max_inflight}", "{tier}"},
		Keys: []KeyMapping{
			{SHA256: sum(aliceKey), Outputs: []string{"alice", "0", "2", "tier-1"}},
			{SHA256: sum(bobKey), Outputs: []string{"bob", "1767225600", "1", "tier-2"}},
		},
		Defaults: []string{"", "0", "1", ""},
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := m.Provision(ctx); err != nil {
		t.Fatalf("provision: %v", err)
	}
	return m
}

// serve runs one request with the given Authorization headers through m and returns the
// placeholders the next handler sees, joined by "|".
func serve(t *testing.T, m *KeyMap, repl *caddy.Replacer, authorization ...string) string {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	for _, a := range authorization {
		r.Header.Add("Authorization", a)
	}
	r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
	var seen []string
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		for _, name := range []string{"user", "expires", "max_inflight", "tier"} {
			value, set := repl.Get(name)
			if !set {
				value = "<unset>"
			}
			seen = append(seen, fmt.Sprint(value))
		}
		return nil
	})
	if err := m.ServeHTTP(httptest.NewRecorder(), r, next); err != nil {
		t.Fatal(err)
	}
	return strings.Join(seen, "|")
}

func TestKnownKeysSetTheirValues(t *testing.T) {
	m := userMap(t)
	for _, c := range []struct{ header, want string }{
		{"Bearer " + aliceKey, "alice|0|2|tier-1"},
		{"Bearer " + bobKey, "bob|1767225600|1|tier-2"},
		{"bearer " + aliceKey, "alice|0|2|tier-1"}, // the scheme name is case-insensitive
	} {
		if got := serve(t, m, caddy.NewReplacer(), c.header); got != c.want {
			t.Errorf("%q: got %q, want %q", c.header, got, c.want)
		}
	}
}

func TestAnythingElseGetsTheDefaults(t *testing.T) {
	m := userMap(t)
	for _, headers := range [][]string{
		nil,
		{""},
		{"Bearer "},
		{"Bearer " + aliceKey + "x"},
		{"Bearer  " + aliceKey},     // the key must follow one space
		{"Basic " + aliceKey},       // another scheme
		{aliceKey},                  // no scheme
		{"Bearer " + sum(aliceKey)}, // the hash itself is not a key
		{"Bearer " + aliceKey, "Bearer " + bobKey}, // two Authorization headers
	} {
		if got := serve(t, m, caddy.NewReplacer(), headers...); got != "|0|1|" {
			t.Errorf("%q: got %q, want the defaults", headers, got)
		}
	}
}

// Values a client could have planted earlier in the chain are overwritten on every request.
func TestEveryDestinationIsSetOnEveryRequest(t *testing.T) {
	m := userMap(t)
	repl := caddy.NewReplacer()
	repl.Set("user", "mallory")
	repl.Set("tier", "unlimited")
	if got := serve(t, m, repl, "Bearer wrong"); got != "|0|1|" {
		t.Fatalf("got %q", got)
	}
	noDefaults := &KeyMap{Destinations: []string{"{user}"}}
	if err := noDefaults.Provision(caddy.Context{}); err != nil {
		t.Fatal(err)
	}
	fresh := caddy.NewReplacer()
	fresh.Set("user", "mallory")
	if got := serve(t, noDefaults, fresh); !strings.HasPrefix(got, "|<unset>|") {
		t.Fatalf("without defaults an unknown key must give an empty user, got %q", got)
	}
}

// 10,000 keys provision and the last one is found (the cost per request is one SHA-256 and one map
// access; BenchmarkLookup shows it does not grow with the number of keys).
func TestManyKeys(t *testing.T) {
	m := &KeyMap{Destinations: []string{"{user}", "{expires}", "{max_inflight}", "{tier}"}}
	for i := 0; i < 10000; i++ {
		m.Keys = append(m.Keys, KeyMapping{SHA256: sum(fmt.Sprintf("key-%d", i)),
			Outputs: []string{fmt.Sprintf("user-%d", i), "0", "1", "t"}})
	}
	if err := m.Provision(caddy.Context{}); err != nil {
		t.Fatal(err)
	}
	if got := serve(t, m, caddy.NewReplacer(), "Bearer key-9999"); got != "user-9999|0|1|t" {
		t.Fatalf("got %q", got)
	}
}

func TestValidationNamesTheProblem(t *testing.T) {
	dest := []string{"{user}", "{tier}"}
	good := sum(aliceKey)
	cases := []struct {
		m       KeyMap
		errPart string
	}{
		{KeyMap{}, "at least one destination"},
		{KeyMap{Destinations: []string{"user"}}, "destination 0 (\"user\") must be one placeholder"},
		{KeyMap{Destinations: []string{"{a}{b}"}}, "must be one placeholder"},
		{KeyMap{Destinations: dest, Defaults: []string{""}}, "1 defaults for 2 destinations"},
		{KeyMap{Destinations: dest, Keys: []KeyMapping{{SHA256: "abc", Outputs: []string{"a", "t"}}}},
			"key 0: sha256 must be 64 lowercase hex digits, got 3"},
		{KeyMap{Destinations: dest, Keys: []KeyMapping{{SHA256: strings.ToUpper(good), Outputs: []string{"a", "t"}}}},
			"lowercase"},
		{KeyMap{Destinations: dest, Keys: []KeyMapping{{SHA256: strings.Repeat("z", 64), Outputs: []string{"a", "t"}}}},
			"not hex"},
		{KeyMap{Destinations: dest, Keys: []KeyMapping{{SHA256: good, Outputs: []string{"a"}}}},
			"has 1 outputs for 2 destinations"},
		{KeyMap{Destinations: dest, Keys: []KeyMapping{
			{SHA256: good, Outputs: []string{"a", "t"}}, {SHA256: good, Outputs: []string{"b", "t"}}}},
			"key 1 (sha256 " + good[:8] + "...) repeats key 0"},
	}
	for _, c := range cases {
		err := c.m.Provision(caddy.Context{})
		if err == nil || !strings.Contains(err.Error(), c.errPart) {
			t.Errorf("%+v: want an error with %q, got %v", c.m, c.errPart, err)
		}
	}
}

func TestKeyMapCaddyfile(t *testing.T) {
	in := "api_key_map {user} {tier} {\n " + sum(aliceKey) + " alice tier-1\n default \"\" none\n}"
	m := new(KeyMap)
	if err := m.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil {
		t.Fatal(err)
	}
	if strings.Join(m.Destinations, ",") != "{user},{tier}" || len(m.Keys) != 1 ||
		m.Keys[0].SHA256 != sum(aliceKey) || strings.Join(m.Keys[0].Outputs, ",") != "alice,tier-1" ||
		strings.Join(m.Defaults, ",") != ",none" {
		t.Fatalf("parsed %+v", m)
	}
	for in, errPart := range map[string]string{
		"api_key_map {\n}": "at least one destination",
		"api_key_map {user} {\n default a\n default b\n}": "default given twice",
		"api_key_map {user} {\n default\n default b\n}":   "default needs one value per destination",
	} {
		if err := new(KeyMap).UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err == nil ||
			!strings.Contains(err.Error(), errPart) {
			t.Errorf("%q: want an error with %q, got %v", in, errPart, err)
		}
	}
}

// In a real site block the directive is ordered before the handlers that read its placeholders: vars
// (the directive Caddy orders right after map, so every later one follows too) and a route; the
// adapted config carries the hash, not the key.
func TestKeyMapAdaptsBeforeItsReaders(t *testing.T) {
	input := `:8080 {
	route {
		respond "{user}"
	}
	vars checked {user}
	api_key_map {user} {
		` + sum(aliceKey) + ` alice
		default ""
	}
}`
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := string(out)
	keymap := strings.Index(s, `"handler":"api_key_map"`)
	for _, reader := range []string{`"handler":"vars"`, `"handler":"subroute"`} {
		if at := strings.Index(s, reader); keymap < 0 || at < 0 || keymap > at {
			t.Fatalf("api_key_map must come before %s: %s", reader, s)
		}
	}
	if !strings.Contains(s, sum(aliceKey)) || strings.Contains(s, aliceKey) {
		t.Fatalf("adapted JSON must hold the hash and not the key: %s", s)
	}
}

// BenchmarkLookup: ns per request with 10 and with 10,000 keys (go test -bench Lookup -run '^$').
func BenchmarkLookup(b *testing.B) {
	for _, n := range []int{10, 10000} {
		m := &KeyMap{Destinations: []string{"{user}"}}
		for i := 0; i < n; i++ {
			m.Keys = append(m.Keys, KeyMapping{SHA256: sum(fmt.Sprintf("key-%d", i)), Outputs: []string{"u"}})
		}
		if err := m.Provision(caddy.Context{}); err != nil {
			b.Fatal(err)
		}
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
		r.Header.Set("Authorization", fmt.Sprintf("Bearer key-%d", n-1))
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if out, _ := m.lookup(r); out[0] != "u" {
					b.Fatal("not found")
				}
			}
		})
	}
}

const frontKey = "k3yOfTheFrontGatewayWith48CharactersZZZZZZZZZZZZZ"

// A front gateway's key may name the person a request is for (X-Teamserve-Person): the person's own
// values apply. Nobody else's header counts, a name nobody listed leaves the front's own values, and the
// header never reaches the handlers after the map (nor the engine).
func TestOnBehalfOfOnlyForTheHopsKey(t *testing.T) {
	m := userMap(t)
	m.Keys = append(m.Keys, KeyMapping{SHA256: sum(frontKey), Outputs: []string{"teamserve-front", "0", "16", "tier-0"}})
	m.OnBehalfOf = &OnBehalfOf{Header: "X-Teamserve-Person", User: "teamserve-front", Persons: map[string][]string{
		"alice": {"alice", "0", "8", ""}, "carol": {"carol", "1767225600", "1", ""}}}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := m.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		key     string
		persons []string
		want    string
		via     string
	}{
		{frontKey, []string{"alice"}, "alice|0|8|", "teamserve-front"},
		{frontKey, []string{"carol"}, "carol|1767225600|1|", "teamserve-front"},
		{frontKey, nil, "teamserve-front|0|16|tier-0", ""},
		{frontKey, []string{"mallory"}, "teamserve-front|0|16|tier-0", ""},
		{frontKey, []string{"alice", "carol"}, "teamserve-front|0|16|tier-0", ""},
		{frontKey, []string{"Alice"}, "teamserve-front|0|16|tier-0", ""},
		{bobKey, []string{"alice"}, "bob|1767225600|1|tier-2", ""},
		{"no-such-key", []string{"alice"}, "|0|1|", ""},
	} {
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
		r.Header.Set("Authorization", "Bearer "+c.key)
		for _, p := range c.persons {
			r.Header.Add("X-Teamserve-Person", p)
		}
		repl := caddy.NewReplacer()
		r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
		var got, via string
		var leaked []string
		next := caddyhttp.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) error {
			var seen []string
			for _, name := range []string{"user", "expires", "max_inflight", "tier"} {
				value, _ := repl.Get(name)
				seen = append(seen, fmt.Sprint(value))
			}
			got, leaked = strings.Join(seen, "|"), r.Header.Values("X-Teamserve-Person")
			v, _ := repl.Get(OnBehalfOfPlaceholder)
			via = fmt.Sprint(v)
			return nil
		})
		if err := m.ServeHTTP(httptest.NewRecorder(), r, next); err != nil {
			t.Fatal(err)
		}
		if got != c.want || via != c.via || len(leaked) != 0 {
			t.Errorf("key %.12s... naming %v: %s via %q (header after the map: %v), want %s via %q",
				c.key, c.persons, got, via, leaked, c.want, c.via)
		}
	}
}

func TestOnBehalfOfCaddyfile(t *testing.T) {
	m := new(KeyMap)
	err := m.UnmarshalCaddyfile(caddyfile.NewTestDispenser(`api_key_map {user} {cap} {
		` + sum(frontKey) + ` teamserve-front 16
		default "" 1
		on_behalf_of X-Teamserve-Person teamserve-front {
			alice alice 8
			bob bob 2
		}
	}`))
	if err != nil || m.OnBehalfOf == nil || m.OnBehalfOf.Header != "X-Teamserve-Person" ||
		len(m.OnBehalfOf.Persons) != 2 || m.OnBehalfOf.Persons["bob"][1] != "2" || len(m.Keys) != 1 {
		t.Fatalf("%+v %v", m.OnBehalfOf, err)
	}
	for _, bad := range []string{
		"api_key_map {user} {\n on_behalf_of X-P\n}",
		"api_key_map {user} {\n on_behalf_of X-P f {\n a a\n a a\n }\n}",
		"api_key_map {user} {\n on_behalf_of X-P f {\n }\n on_behalf_of X-P f {\n }\n}",
	} {
		if err := new(KeyMap).UnmarshalCaddyfile(caddyfile.NewTestDispenser(bad)); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
	bad := &KeyMap{Destinations: []string{"{user}", "{cap}"}, OnBehalfOf: &OnBehalfOf{Header: "X-P", User: "f",
		Persons: map[string][]string{"a": {"a"}}}}
	if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), `"a" has 1 outputs for 2 destinations`) {
		t.Errorf("validate: %v", err)
	}
}
