package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// newRequestPriority provisions p (share "{share}" and lane "{lane}" unless set).
func newRequestPriority(t *testing.T, p RequestPriority) *RequestPriority {
	t.Helper()
	if p.Share == "" {
		p.Share = "{share}"
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := p.Provision(ctx); err != nil {
		t.Fatalf("provision: %v", err)
	}
	return &p
}

// priorityRequest is a POST of body with inflight_limit's in-flight placeholder, {share} and {lane}.
func priorityRequest(body string, inFlight, share int, lane string, chunked bool) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("Content-Length", strconv.Itoa(len(body)))
	if chunked {
		r.Body = io.NopCloser(strings.NewReader(body))
		r.ContentLength = -1
		r.Header.Del("Content-Length")
	}
	repl := caddy.NewReplacer()
	repl.Set(InFlightPlaceholder, inFlight)
	repl.Set("share", strconv.Itoa(share))
	repl.Set("lane", lane)
	return r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
}

// sent is what the next handler got.
type sent struct {
	body          string
	contentLength int64
	lengthHeader  string
	priorityHdr   []string
	placeholder   any
}

func runPriority(t *testing.T, p *RequestPriority, r *http.Request) (*sent, *httptest.ResponseRecorder) {
	t.Helper()
	var got *sent
	w := httptest.NewRecorder()
	err := p.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) error {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			t.Fatal(err)
		}
		repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		v, _ := repl.Get(PriorityPlaceholder)
		got = &sent{string(body), r.ContentLength, r.Header.Get("Content-Length"), r.Header.Values(PriorityHeader), v}
		return nil
	}))
	if err != nil {
		t.Fatalf("ServeHTTP: %v", err)
	}
	return got, w
}

// The client's priority is always replaced, whatever it was, and everything else is byte for byte.
func TestPriorityOverwritesTheClients(t *testing.T) {
	p := newRequestPriority(t, RequestPriority{})
	for _, tc := range []struct{ in, want string }{
		{`{"model":"m","priority":0,"n":1}`, `{"model":"m","priority":3,"n":1}`},
		{`{"model":"m","priority":-100}`, `{"model":"m","priority":3}`},
		{`{"priority":-9223372036854775808,"model":"m"}`, `{"priority":3,"model":"m"}`},
		{`{"priority":"high"}`, `{"priority":3}`},
		{`{"priority":{"level":-5},"x":[1]}`, `{"priority":3,"x":[1]}`},
		{`{"priority":-1,"model":"m","priority":-2}`, `{"priority":3,"model":"m","priority":3}`},
		{`{"\u0070riority":-100,"model":"m"}`, `{"\u0070riority":3,"model":"m"}`},
		{`{ "priority" : -100 , "model" : "m" }`, `{ "priority" : 3 , "model" : "m" }`},
		{`{"model":"m"}`, `{"priority":3,"model":"m"}`},
		{`{}`, `{"priority":3}`},
		{" \n{ }\n", " \n{\"priority\":3 }\n"},
		{`{"messages":[{"role":"user","priority":-100}],"metadata":{"priority":-1}}`,
			`{"priority":3,"messages":[{"role":"user","priority":-100}],"metadata":{"priority":-1}}`},
		{`{"Priority":-100}`, `{"priority":3,"Priority":-100}`},
		// Numbers keep their spelling: no float conversion, no rounding.
		{`{"seed":12345678901234567890123,"temperature":1.0,"top_p":1e-7,"x":-0,"priority":-1}`,
			`{"seed":12345678901234567890123,"temperature":1.0,"top_p":1e-7,"x":-0,"priority":3}`},
		{`{"temperature":NaN,"top_k":-Infinity,"priority":-1}`, `{"temperature":NaN,"top_k":-Infinity,"priority":3}`},
		{"\xef\xbb\xbf{\"priority\":-1}", "\xef\xbb\xbf{\"priority\":3}"},
		{`{"s":"é \u00e9 \"priority\":-1 \\","priority":-1}`, `{"s":"é \u00e9 \"priority\":-1 \\","priority":3}`},
	} {
		for _, chunked := range []bool{false, true} {
			r := priorityRequest(tc.in, 5, 2, "", chunked)
			r.Header.Add(PriorityHeader, "-100")
			r.Header.Add("x-vllm-priority", "-200")
			got, _ := runPriority(t, p, r)
			if got == nil || got.body != tc.want {
				t.Errorf("%s (chunked=%v): forwarded %+v, want %s", tc.in, chunked, got, tc.want)
				continue
			}
			if !reflect.DeepEqual(got.priorityHdr, []string{"3"}) || got.placeholder != 3 {
				t.Errorf("%s: X-Vllm-Priority %q, placeholder %v; want [3] and 3", tc.in, got.priorityHdr, got.placeholder)
			}
			switch {
			case chunked && (got.contentLength != -1 || got.lengthHeader != ""):
				t.Errorf("%s: chunked became length %d (%q)", tc.in, got.contentLength, got.lengthHeader)
			case !chunked && (got.contentLength != int64(len(tc.want)) || got.lengthHeader != strconv.Itoa(len(tc.want))):
				t.Errorf("%s: length %d (header %q), want %d", tc.in, got.contentLength, got.lengthHeader, len(tc.want))
			}
		}
	}
}

// replace_only: a client's priority is still replaced, but a body without one is forwarded as sent
// (a fallback that does not know the field gets what the client wrote); the header carries the value.
func TestPriorityReplaceOnly(t *testing.T) {
	p := newRequestPriority(t, RequestPriority{ReplaceOnly: true})
	for _, tc := range []struct{ in, want string }{
		{`{"model":"m","priority":-100}`, `{"model":"m","priority":3}`},
		{`{"priority":-1,"model":"m","priority":-2}`, `{"priority":3,"model":"m","priority":3}`},
		{`{"model":"m"}`, `{"model":"m"}`},
		{`{"messages":[{"priority":-100}]}`, `{"messages":[{"priority":-100}]}`},
		{`{}`, `{}`},
	} {
		r := priorityRequest(tc.in, 5, 2, "", false)
		r.Header.Set(PriorityHeader, "-100")
		got, _ := runPriority(t, p, r)
		if got == nil || got.body != tc.want || got.lengthHeader != strconv.Itoa(len(tc.want)) {
			t.Errorf("%s: forwarded %+v, want %s", tc.in, got, tc.want)
			continue
		}
		if !reflect.DeepEqual(got.priorityHdr, []string{"3"}) {
			t.Errorf("%s: X-Vllm-Priority %q, want [3]", tc.in, got.priorityHdr)
		}
	}
}

// 0 within the share, 1.. over it (capped below max_priority), max_priority for the batch lane.
func TestPriorityFromShareAndLane(t *testing.T) {
	for _, tc := range []struct {
		inFlight, share, max int
		lane                 string
		want                 int
	}{
		{1, 2, 0, "", 0},
		{2, 2, 0, "", 0},
		{3, 2, 0, "", 1},
		{6, 2, 0, "", 4},
		{11, 2, 0, "", 9},
		{50, 2, 0, "", 9},
		{50, 2, 4, "", 3},
		{1, 0, 0, "", 1},
		{0, 0, 0, "", 0},
		{1, 2, 0, "batch", 10},
		{50, 2, 0, "batch", 10},
		{1, 2, 4, "batch", 4},
		{1, 2, 0, " batch ", 10},
		{3, 2, 0, "interactive", 1},
		{3, 2, 0, "Batch", 1},
	} {
		p := newRequestPriority(t, RequestPriority{Lane: "{lane}", MaxPriority: tc.max})
		got, _ := runPriority(t, p, priorityRequest(`{"priority":-100}`, tc.inFlight, tc.share, tc.lane, false))
		if want := `{"priority":` + strconv.Itoa(tc.want) + `}`; got == nil || got.body != want {
			t.Errorf("in flight %d, share %d, lane %q, max %d: %+v, want %s", tc.inFlight, tc.share, tc.lane, tc.max, got, want)
		}
	}
	// Share given as a number; no lane option: "batch" in {lane} means nothing.
	p := newRequestPriority(t, RequestPriority{Share: "4"})
	if got, _ := runPriority(t, p, priorityRequest(`{}`, 5, 0, "batch", false)); got.body != `{"priority":1}` {
		t.Fatalf("share 4, in flight 5: %s", got.body)
	}
}

// Bodies that are not a JSON object pass unchanged; the header is still the gateway's.
func TestPriorityLeavesOtherBodiesAlone(t *testing.T) {
	p := newRequestPriority(t, RequestPriority{})
	for _, tc := range []struct{ contentType, body string }{
		{"application/json", `[{"priority":-100}]`},
		{"application/json", `{"priority":-100`},
		{"application/json", `"priority"`},
		{"application/json", `priority=-100`},
		{"application/json", `{"priority":-100} {}`},
		{"text/plain", `{"priority":-100}`},
		{"", `{"priority":-100}`},
	} {
		r := priorityRequest(tc.body, 5, 2, "", false)
		r.Header.Set("Content-Type", tc.contentType)
		r.Header.Set(PriorityHeader, "-100")
		got, _ := runPriority(t, p, r)
		if got == nil || got.body != tc.body || got.contentLength != int64(len(tc.body)) || !reflect.DeepEqual(got.priorityHdr, []string{"3"}) {
			t.Errorf("%s %s: %+v", tc.contentType, tc.body, got)
		}
	}
	r := priorityRequest("", 5, 2, "", false)
	r.Method, r.Body, r.ContentLength = http.MethodGet, http.NoBody, 0
	if got, _ := runPriority(t, p, r); got == nil || got.body != "" || !reflect.DeepEqual(got.priorityHdr, []string{"3"}) {
		t.Errorf("GET: %+v", got)
	}
}

// A JSON body in UTF-16 is refused: the engine would read its priority, the gateway could not replace it.
func TestPriorityRefusesUTF16(t *testing.T) {
	p := newRequestPriority(t, RequestPriority{})
	var b bytes.Buffer
	for _, c := range `{"priority":-100}` {
		b.WriteByte(byte(c))
		b.WriteByte(0)
	}
	got, w := runPriority(t, p, priorityRequest(b.String(), 1, 2, "", false))
	if got != nil || w.Code != http.StatusBadRequest || errorOf(t, w).Code != CodeUnsupportedEncoding {
		t.Fatalf("forwarded %+v, status %d %s", got, w.Code, w.Body.String())
	}
}

// Missing or unusable inputs are configuration errors: 500, nothing forwarded.
func TestPriorityUnusableInputsFailClosed(t *testing.T) {
	p := newRequestPriority(t, RequestPriority{})
	for _, tc := range []struct {
		inFlight any
		share    string
		part     string
	}{
		{nil, "2", "is inflight_limit before this handler?"},
		{"x", "2", `in_flight "x"`},
		{-1, "2", `in_flight "-1"`},
		{1, "", `share ""`},
		{1, "-2", `share "-2"`},
	} {
		r := priorityRequest(`{}`, 0, 0, "", false)
		repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		if tc.inFlight == nil {
			repl.Delete(InFlightPlaceholder)
		} else {
			repl.Set(InFlightPlaceholder, tc.inFlight)
		}
		repl.Set("share", tc.share)
		err := p.ServeHTTP(httptest.NewRecorder(), r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
			t.Errorf("%+v: forwarded", tc)
			return nil
		}))
		if statusOf(err) != http.StatusInternalServerError || !strings.Contains(err.Error(), tc.part) {
			t.Errorf("%+v: want a 500 with %q, got %v", tc, tc.part, err)
		}
	}
}

func TestPriorityBodyLimit(t *testing.T) {
	p := newRequestPriority(t, RequestPriority{MaxSize: 16})
	r := priorityRequest(`{"model":"a-long-model-name"}`, 1, 2, "", false)
	err := p.ServeHTTP(httptest.NewRecorder(), r, nil)
	if statusOf(err) != http.StatusRequestEntityTooLarge || !strings.Contains(err.Error(), "request_priority: request body larger than 16 bytes") {
		t.Fatalf("%v, want 413", err)
	}
}

func TestPriorityCaddyfile(t *testing.T) {
	for in, want := range map[string]RequestPriority{
		"request_priority 2":                 {Share: "2"},
		"request_priority {teamserve_share}": {Share: "{teamserve_share}"},
		"request_priority {\n share 3\n}":    {Share: "3"},
		"request_priority {\n share {s}\n in_flight {x}\n lane {teamserve_lane}\n max_priority 20\n max_size 1024\n}": {
			Share: "{s}", InFlight: "{x}", Lane: "{teamserve_lane}", MaxPriority: 20, MaxSize: 1024},
		"request_priority 2 {\n replace_only\n}": {Share: "2", ReplaceOnly: true},
	} {
		p := new(RequestPriority)
		if err := p.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil || *p != want {
			t.Errorf("%q: got %+v, %v; want %+v", in, p, err, want)
		}
	}
	for in, errPart := range map[string]string{
		"request_priority":                           "needs a share",
		"request_priority 1 2":                       "no arguments or <share>, got 2",
		"request_priority {\n lane {l}\n}":           "needs a share",
		"request_priority 2 {\n max_priority 1\n}":   `max_priority "1" must be a whole number >= 2`,
		"request_priority 2 {\n max_size 0\n}":       `max_size "0"`,
		"request_priority 2 {\n lane\n}":             "wrong argument count",
		"request_priority 2 {\n lane {a} {b}\n}":     "wrong argument count",
		"request_priority 2 {\n weight 3\n}":         `unknown request_priority option "weight"`,
		"request_priority 2 {\n replace_only yes\n}": "wrong argument count",
	} {
		if err := new(RequestPriority).UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err == nil || !strings.Contains(err.Error(), errPart) {
			t.Errorf("%q: want an error with %q, got %v", in, errPart, err)
		}
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for _, tc := range []struct {
		p    RequestPriority
		part string
	}{
		{RequestPriority{}, "share is required"},
		{RequestPriority{Share: "-1"}, `share "-1": must be >= 0`},
		{RequestPriority{Share: "two"}, `share "two": not an integer`},
		{RequestPriority{Share: "2", InFlight: "3"}, `in_flight "3" must be a placeholder`},
		{RequestPriority{Share: "2", MaxPriority: 1}, "max_priority 1 must be >= 2"},
		{RequestPriority{Share: "2", MaxSize: -1}, "max_size -1"},
	} {
		if err := tc.p.Provision(ctx); err == nil || !strings.Contains(err.Error(), tc.part) {
			t.Errorf("%+v: want an error with %q, got %v", tc.p, tc.part, err)
		}
	}
}

// FuzzWithMember checks the byte-level rewrite against encoding/json: for any JSON object, the result
// is JSON whose members are the input's (numbers compared as written) with priority set.
func FuzzWithMember(f *testing.F) {
	for _, seed := range []string{
		`{}`, ` { } `, `{"priority":1}`, `{"a":1,"priority":2,"priority":3}`, `{"\u0070riority":"x"}`,
		`{"a":{"priority":1},"b":[{"priority":2}]}`, `{"a":"\"priority\":1"}`, `{"a":12345678901234567890,"b":1.50,"c":-0.0e+1}`,
		`{"priorit":1,"prioritys":2}`, `{"a\\":"\\","priority":null}`, "{\"a\":\"\\ud800\"}",
	} {
		f.Add([]byte(seed), int64(7))
	}
	f.Fuzz(func(t *testing.T, doc []byte, priority int64) {
		var in map[string]any
		if !json.Valid(doc) || decodeNumbers(doc, &in) != nil || in == nil {
			return // not an object
		}
		value := strconv.FormatInt(priority, 10)
		out := withMember(doc, "priority", []byte(value))
		var got map[string]any
		if err := decodeNumbers(out, &got); err != nil {
			t.Fatalf("%q -> %q: not JSON: %v", doc, out, err)
		}
		in["priority"] = json.Number(value)
		if !reflect.DeepEqual(in, got) {
			t.Fatalf("%q -> %q: members %v, want %v", doc, out, got, in)
		}
	})
}

func decodeNumbers(doc []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(doc))
	d.UseNumber()
	return d.Decode(v)
}

func TestEngineJSON(t *testing.T) {
	for _, tc := range []struct {
		body   string
		kind   docKind
		prefix int
	}{
		{`{"a":1}`, docObject, 0},
		{" \t\r\n{}", docObject, 0},
		{"\xef\xbb\xbf{}", docObject, 3},
		{`[1]`, docOther, 0},
		{`null`, docOther, 0},
		{`{"a":NaN,"b":[Infinity,-Infinity]}`, docObject, 0},
		{`NaN`, docOther, 0},
		{`{"a":"NaN"}`, docObject, 0},
		{`{"a":nan}`, docInvalid, 0},
		{`{"a":-NaN}`, docInvalid, 0},
		{`{"a":+Infinity}`, docInvalid, 0},
		{`{"a":1NaN}`, docInvalid, 0},
		{`{"a":NaN1}`, docInvalid, 0},
		{`{"a":Infinity.5}`, docInvalid, 0},
		{`{"a":1,}`, docInvalid, 0},
		{``, docInvalid, 0},
		{"\xff\xfe{\x00}\x00", docNotUTF8, 0},
		{"\xfe\xff\x00{\x00}", docNotUTF8, 0},
		{"{\x00}\x00", docNotUTF8, 0},
		{"\x00{\x00}", docNotUTF8, 0},
		{"{\x00", docNotUTF8, 0},
		{"{}\x00", docInvalid, 0}, // three bytes: json.detect_encoding says UTF-8
	} {
		_, prefix, kind := engineJSON([]byte(tc.body))
		if kind != tc.kind || prefix != tc.prefix {
			t.Errorf("%q: kind %d, prefix %d; want %d, %d", tc.body, kind, prefix, tc.kind, tc.prefix)
		}
	}
}

// Beam search runs every beam step at the engine's first priority: it is served at priority 0 only, and
// refused naming use_beam_search, in any spelling the engine reads as true, where it would jump a lane.
func TestPriorityBeamSearchKeepsItsLane(t *testing.T) {
	p := newRequestPriority(t, RequestPriority{Lane: "{lane}"})
	for _, tc := range []struct {
		body     string
		inFlight int
		lane     string
		served   bool
	}{
		{`{"use_beam_search":true,"n":2}`, 2, "", true},
		{`{"use_beam_search":true,"n":2}`, 3, "", false},
		{`{"use_beam_search":"yes"}`, 1, "batch", false},
		{`{"use_beam_search":true,"use_beam_search":0}`, 1, "batch", true},
		{`{"use_beam_\u0073earch":1}`, 1, "batch", false},
		{`{"use_beam_search":false}`, 1, "batch", true},
	} {
		got, w := runPriority(t, p, priorityRequest(tc.body, tc.inFlight, 2, tc.lane, false))
		if served := got != nil; served != tc.served {
			t.Errorf("%s in flight %d lane %q: served %v, want %v (%d %s)", tc.body, tc.inFlight, tc.lane, served, tc.served, w.Code, w.Body)
			continue
		}
		if !tc.served {
			if e := errorOf(t, w); w.Code != http.StatusBadRequest || e.Code != CodeUnsupportedField || e.Param == nil || *e.Param != "use_beam_search" {
				t.Errorf("%s: %d %s, want 400 unsupported_field naming use_beam_search", tc.body, w.Code, w.Body)
			}
		}
	}
}
