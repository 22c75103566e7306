package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// newRequestCost provisions a handler setting {teamserve_cost}, with maxSize (0 = the default).
func newRequestCost(t testing.TB, maxSize int64) *RequestCost {
	t.Helper()
	c := &RequestCost{Destination: "{teamserve_cost}", MaxSize: maxSize}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := c.Provision(ctx); err != nil {
		t.Fatalf("provision: %v", err)
	}
	return c
}

// costRequest builds a POST to path with a JSON body (chunked: length unknown) and a fresh replacer.
func costRequest(path, body string, chunked bool) (*http.Request, *caddy.Replacer) {
	r := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	if chunked {
		r.Body = io.NopCloser(strings.NewReader(body))
		r.ContentLength = -1
	}
	repl := caddy.NewReplacer()
	return r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl)), repl
}

// costOutcome is what a request through request_cost came to.
type costOutcome struct {
	cost      Cost   // the placeholder's value the next handler saw
	forwarded []byte // the body the next handler read; nil if it was not called
	status    int    // the response status when refused
	errBody   openAIErrorBody
}

func runCost(t *testing.T, c *RequestCost, r *http.Request, repl *caddy.Replacer) costOutcome {
	t.Helper()
	var out costOutcome
	next := caddyhttp.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) error {
		v, _ := repl.Get("teamserve_cost")
		out.cost, _ = v.(Cost)
		body, err := io.ReadAll(r.Body)
		if err != nil {
			t.Errorf("next handler reading the body: %v", err)
		}
		out.forwarded = append([]byte{}, body...)
		return nil
	})
	w := httptest.NewRecorder()
	if err := c.ServeHTTP(w, r, next); err != nil {
		t.Fatalf("ServeHTTP: %v", err)
	}
	if out.forwarded == nil {
		out.status = w.Code
		var e openAIError
		if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil {
			t.Fatalf("refusal body %q: %v", w.Body.String(), err)
		}
		out.errBody = e.Error
	}
	return out
}

// Each request shape costs what vLLM will run for it, and the body reaches the next handler as sent.
func TestRequestCostOfEachShape(t *testing.T) {
	c := newRequestCost(t, 0)
	const chat, cmpl, embed, resp = "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"
	for _, tc := range []struct {
		name, path, body string
		want             Cost
	}{
		{"chat, n absent", chat, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, Cost{1, 1, 1, ""}},
		{"chat, n null", chat, `{"messages":[],"n":null}`, Cost{1, 1, 1, ""}},
		{"chat, n 1", chat, `{"messages":[],"n":1}`, Cost{1, 1, 1, ""}},
		{"chat, n 4", chat, `{"n":4,"messages":[{"role":"user","content":"n=8"}]}`, Cost{4, 4, 1, ""}},
		{"chat, n 2.0 (pydantic reads 2)", chat, `{"messages":[],"n":2.0}`, Cost{2, 2, 1, ""}},
		{"chat, n 3e0", chat, `{"messages":[],"n":3e0}`, Cost{3, 3, 1, ""}},
		{"chat, prompt ignored", chat, `{"messages":[],"prompt":["a","b","c"]}`, Cost{1, 1, 1, ""}},
		{"chat, n nested only", chat, `{"messages":[{"n":8}],"tools":[{"n":8}]}`, Cost{1, 1, 1, ""}},
		{"chat, n repeated: the last counts", chat, `{"n":1,"messages":[],"n":6}`, Cost{6, 6, 1, ""}},
		{"chat, n escaped name", chat, `{"\u006e":5,"messages":[]}`, Cost{5, 5, 1, ""}},
		{"chat, huge n saturates", chat, `{"n":123456789012345678901234567890}`, Cost{MaxCost, MaxCost, 1, ""}},
		{"completions, string", cmpl, `{"prompt":"Once upon"}`, Cost{1, 1, 1, "prompt"}},
		{"completions, string n 3", cmpl, `{"prompt":"Once upon","n":3}`, Cost{3, 3, 1, "prompt"}},
		{"completions, list of strings", cmpl, `{"prompt":["a","b","c"],"n":2}`, Cost{6, 2, 3, "prompt"}},
		{"completions, token ids (one prompt)", cmpl, `{"prompt":[1,2,3,4,5],"n":2}`, Cost{2, 2, 1, "prompt"}},
		{"completions, list of token-id lists", cmpl, `{"prompt":[[1,2],[3],[],[4,5,6]],"n":2}`, Cost{8, 2, 4, "prompt"}},
		{"completions, 8 prompts n 8", cmpl, `{"prompt":["a","b","c","d","e","f","g","h"],"n":8}`, Cost{64, 8, 8, "prompt"}},
		{"completions, no prompt", cmpl, `{"model":"m"}`, Cost{1, 1, 1, "prompt"}},
		{"completions, prompt null", cmpl, `{"prompt":null,"n":2}`, Cost{2, 2, 1, "prompt"}},
		{"completions, empty list", cmpl, `{"prompt":[]}`, Cost{1, 1, 1, "prompt"}},
		{"completions, empty list and embeds", cmpl, `{"prompt":[],"prompt_embeds":["AAA=","BBB="]}`, Cost{2, 1, 2, "prompt_embeds"}},
		{"completions, empty embeds and prompts", cmpl, `{"prompt_embeds":[],"prompt":["a","b"]}`, Cost{2, 1, 2, "prompt"}},
		{"completions, prompt_embeds list", cmpl, `{"prompt_embeds":["AAA=","BBB=","CCC="]}`, Cost{3, 1, 3, "prompt_embeds"}},
		{"completions, prompt_embeds and prompts", cmpl, `{"prompt_embeds":"AAA=","prompt":["a","b"],"n":2}`, Cost{6, 2, 3, "prompt"}},
		{"completions, NaN elsewhere (the engine parses it)", cmpl, `{"prompt":["a","b"],"temperature":NaN,"top_p":-Infinity}`, Cost{2, 1, 2, "prompt"}},
		{"completions, byte order mark", cmpl, "\xef\xbb\xbf{\"prompt\":[\"a\",\"b\"]}", Cost{2, 1, 2, "prompt"}},
		{"completions, spaces everywhere", cmpl, " {\n \"prompt\" : [ \"a\" , \"b\" ] ,\t\"n\" :\r3 } ", Cost{6, 3, 2, "prompt"}},
		{"embeddings, string", embed, `{"input":"text"}`, Cost{1, 1, 1, "input"}},
		{"embeddings, list of strings", embed, `{"input":["a","b","c","d"]}`, Cost{4, 1, 4, "input"}},
		{"embeddings, token ids", embed, `{"input":[1,2,3]}`, Cost{1, 1, 1, "input"}},
		{"embeddings, token-id lists", embed, `{"input":[[1],[2],[3]]}`, Cost{3, 1, 3, "input"}},
		{"embeddings, n is no field of theirs", embed, `{"input":["a","b"],"n":8}`, Cost{2, 1, 2, "input"}},
		{"embeddings, chat-style", embed, `{"messages":[{"role":"user","content":"x"}]}`, Cost{1, 1, 1, ""}},
		{"responses", resp, `{"input":["a","b","c"],"n":8}`, Cost{1, 1, 1, ""}},
		{"other path", "/tokenize", `{"prompt":["a","b","c"],"n":8}`, Cost{1, 1, 1, ""}},
		{"other path, bad n not looked at", "/v1/score", `{"n":"two"}`, Cost{1, 1, 1, ""}},
		{"a path vLLM does not route", "/v1/completions/", `{"prompt":["a","b"]}`, Cost{1, 1, 1, ""}},
		{"not JSON", cmpl, `prompt=a&n=8`, Cost{1, 1, 1, ""}},
		{"truncated JSON", cmpl, `{"prompt":["a","b"],"n":8`, Cost{1, 1, 1, ""}},
		{"top-level array", cmpl, `[{"prompt":["a","b"],"n":8}]`, Cost{1, 1, 1, ""}},
		{"1NaN is not a number to the engine either", cmpl, `{"prompt":["a","b"],"n":1NaN}`, Cost{1, 1, 1, ""}},
	} {
		for _, chunked := range []bool{false, true} {
			r, repl := costRequest(tc.path, tc.body, chunked)
			out := runCost(t, c, r, repl)
			if out.forwarded == nil {
				t.Errorf("%s: refused %d %+v", tc.name, out.status, out.errBody)
				continue
			}
			if out.cost != tc.want {
				t.Errorf("%s (chunked=%v): cost %+v, want %+v", tc.name, chunked, out.cost, tc.want)
			}
			if string(out.forwarded) != tc.body {
				t.Errorf("%s: forwarded %q, want the body as sent", tc.name, out.forwarded)
			}
		}
	}
	// The placeholder's text is the number.
	r, repl := costRequest(cmpl, `{"prompt":["a","b"],"n":8}`, false)
	runCost(t, c, r, repl)
	if got := repl.ReplaceAll("{teamserve_cost}", ""); got != "16" {
		t.Fatalf("{teamserve_cost} = %q, want 16", got)
	}
}

// Requests without a JSON body cost 1 and are not read.
func TestRequestCostWithoutJSONBody(t *testing.T) {
	c := newRequestCost(t, 0)
	for _, contentType := range []string{"", "text/plain", "application/x-www-form-urlencoded", "application/jsonl"} {
		r, repl := costRequest("/v1/completions", `{"prompt":["a","b"],"n":8}`, false)
		r.Header.Set("Content-Type", contentType)
		r.Body = &countingReader{forbid: true}
		var seen any
		next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { seen, _ = repl.Get("teamserve_cost"); return nil })
		if err := c.ServeHTTP(httptest.NewRecorder(), r, next); err != nil || seen != unitCost {
			t.Errorf("Content-Type %q: %v, cost %v; want 1, body unread", contentType, err, seen)
		}
	}
	r := httptest.NewRequest(http.MethodGet, "/v1/models", nil)
	repl := caddy.NewReplacer()
	repl.Set("teamserve_cost", "planted")
	r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
	var seen any
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { seen, _ = repl.Get("teamserve_cost"); return nil })
	if err := c.ServeHTTP(httptest.NewRecorder(), r, next); err != nil || seen != unitCost {
		t.Fatalf("GET: %v, %v", err, seen)
	}
}

// A bad n is refused with 400 naming n and what is allowed; nothing is forwarded.
func TestRequestCostRefusesBadN(t *testing.T) {
	c := newRequestCost(t, 0)
	for _, tc := range []struct{ body, code, got string }{
		{`{"messages":[],"n":0}`, CodeBelowMinValue, "got 0."},
		{`{"messages":[],"n":-1}`, CodeBelowMinValue, "got -1."},
		{`{"messages":[],"n":-99999999999999999999999}`, CodeBelowMinValue, "got -9999"},
		{`{"messages":[],"n":0.0}`, CodeBelowMinValue, "got 0.0."},
		{`{"messages":[],"n":1.5}`, CodeInvalidType, "got 1.5."},
		{`{"messages":[],"n":1e400}`, CodeInvalidType, "got 1e400."},
		{`{"messages":[],"n":"2"}`, CodeInvalidType, `got a string ("2")`},
		{`{"messages":[],"n":true}`, CodeInvalidType, "got a boolean (true)"},
		{`{"messages":[],"n":[2]}`, CodeInvalidType, "got a list"},
		{`{"messages":[],"n":{"value":2}}`, CodeInvalidType, "got an object"},
		{`{"messages":[],"n":NaN}`, CodeInvalidType, "got NaN."},
		{`{"messages":[],"n":Infinity}`, CodeInvalidType, "got Infinity."},
		{`{"messages":[],"n":4,"n":0}`, CodeBelowMinValue, "got 0."}, // the last counts
	} {
		for _, path := range []string{"/v1/chat/completions", "/v1/completions"} {
			r, repl := costRequest(path, tc.body, false)
			out := runCost(t, c, r, repl)
			if out.forwarded != nil || out.status != http.StatusBadRequest {
				t.Errorf("%s %s: forwarded %v, status %d; want 400", path, tc.body, out.forwarded != nil, out.status)
				continue
			}
			e := out.errBody
			if e.Param == nil || *e.Param != "n" || e.Code != tc.code || e.Type != "invalid_request_error" ||
				!strings.Contains(e.Message, "n (the number of choices to generate for each prompt) must be an integer >= 1") ||
				!strings.Contains(e.Message, tc.got) {
				t.Errorf("%s %s: error %+v (param %v)", path, tc.body, e, e.Param)
			}
		}
	}
}

// Prompt lists of a shape the engine refuses are refused here with 400 naming the field.
func TestRequestCostRefusesBadPromptShapes(t *testing.T) {
	c := newRequestCost(t, 0)
	for _, tc := range []struct{ path, body, param, part string }{
		{"/v1/completions", `{"prompt":["a",1]}`, "prompt", "this list mixes strings (entry 0) and token ids (entry 1)"},
		{"/v1/completions", `{"prompt":[1,"a"]}`, "prompt", "mixes token ids (entry 0) and strings (entry 1)"},
		{"/v1/completions", `{"prompt":[[1,2],"a"]}`, "prompt", "mixes token-id lists (entry 0) and strings (entry 1)"},
		{"/v1/completions", `{"prompt":[[1,2],3]}`, "prompt", "mixes token-id lists (entry 0) and token ids (entry 1)"},
		{"/v1/completions", `{"prompt":[[1,[2]]]}`, "prompt", "entry 0 is a token-id list, whose entry 1 is a list"},
		{"/v1/completions", `{"prompt":[[[1]]]}`, "prompt", "entry 0 is a token-id list, whose entry 0 is a list"},
		{"/v1/completions", `{"prompt":[["a"]]}`, "prompt", "whose entry 0 is a string"},
		{"/v1/completions", `{"prompt":["a",null]}`, "prompt", "entry 1 is null"},
		{"/v1/completions", `{"prompt":[true]}`, "prompt", "entry 0 is a boolean"},
		{"/v1/completions", `{"prompt":[{"prompt":"a"}]}`, "prompt", "entry 0 is an object"},
		{"/v1/completions", `{"prompt":42}`, "prompt", "got a number"},
		{"/v1/completions", `{"prompt":{"text":"a"}}`, "prompt", "got an object"},
		{"/v1/completions", `{"prompt":false}`, "prompt", "got a boolean"},
		{"/v1/completions", `{"prompt_embeds":["AAA=",1]}`, "prompt_embeds", "entry 1 is a number"},
		{"/v1/completions", `{"prompt_embeds":7}`, "prompt_embeds", "got a number"},
		{"/v1/embeddings", `{"input":["a",[1]]}`, "input", "input must be a string, a list of strings"},
		{"/v1/embeddings", `{"input":3}`, "input", "got a number"},
	} {
		r, repl := costRequest(tc.path, tc.body, false)
		out := runCost(t, c, r, repl)
		if out.forwarded != nil || out.status != http.StatusBadRequest {
			t.Errorf("%s: forwarded %v, status %d; want 400", tc.body, out.forwarded != nil, out.status)
			continue
		}
		e := out.errBody
		if e.Param == nil || *e.Param != tc.param || e.Code != CodeInvalidType || !strings.Contains(e.Message, tc.part) {
			t.Errorf("%s: error %+v (param %v), want param %s and %q", tc.body, e, e.Param, tc.param, tc.part)
		}
	}
}

// A body the engine would decode from UTF-16 or UTF-32 is refused: the gateway would count it as 1.
func TestRequestCostRefusesUTF16(t *testing.T) {
	c := newRequestCost(t, 0)
	utf16 := func(s string, bom bool) string {
		var b bytes.Buffer
		if bom {
			b.WriteString("\xff\xfe")
		}
		for _, r := range s {
			b.WriteByte(byte(r))
			b.WriteByte(0)
		}
		return b.String()
	}
	for _, body := range []string{utf16(`{"prompt":["a","b"],"n":8}`, true), utf16(`{"prompt":["a","b"],"n":8}`, false),
		"\x00\x00\x00{", "\xfe\xff\x00{"} {
		r, repl := costRequest("/v1/completions", body, false)
		out := runCost(t, c, r, repl)
		if out.status != http.StatusBadRequest || out.errBody.Code != CodeUnsupportedEncoding || out.errBody.Param != nil {
			t.Errorf("%q: %d %+v", body, out.status, out.errBody)
		}
	}
}

// 10,000 prompts are counted without decoding them: quickly, in about as much memory as the body.
func TestRequestCostTenThousandPrompts(t *testing.T) {
	c := newRequestCost(t, 0)
	prompts := make([]string, 10000)
	for i := range prompts {
		prompts[i] = fmt.Sprintf(`"prompt number %d with \"quotes\", [brackets] and {braces}"`, i)
	}
	body := `{"model":"m","prompt":[` + strings.Join(prompts, ",") + `],"n":2}`
	start := time.Now()
	r, repl := costRequest("/v1/completions", body, false)
	out := runCost(t, c, r, repl)
	if elapsed := time.Since(start); elapsed > time.Second {
		t.Errorf("took %v", elapsed)
	}
	if out.cost != (Cost{20000, 2, 10000, "prompt"}) {
		t.Fatalf("cost %+v", out.cost)
	}
	allocs := testing.AllocsPerRun(5, func() {
		if cost, err := requestCost("/v1/completions", []byte(body)); err != nil || cost.Sequences != 20000 {
			t.Fatal(cost, err)
		}
	})
	if allocs > 10 {
		t.Errorf("%v allocations to count 10,000 prompts, want a few", allocs)
	}
}

// One read serves request_model and request_cost: the second finds the body already held.
func TestRequestCostSharesTheBodyWithRequestModel(t *testing.T) {
	m := newRequestModel(t, 0)
	c := newRequestCost(t, 0)
	body := `{"model":"m","prompt":["a","b","c"],"n":2}`
	reader := &countingReader{r: strings.NewReader(body)}
	r, repl := costRequest("/v1/completions", body, true)
	r.Body = reader
	var got []byte
	final := caddyhttp.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) error {
		got, _ = io.ReadAll(r.Body)
		return nil
	})
	err := m.ServeHTTP(httptest.NewRecorder(), r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		held := r.Body
		return c.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			if r.Body != held {
				t.Error("request_cost replaced a body request_model had already read")
			}
			return final(w, r)
		}))
	}))
	model, _ := repl.Get("teamserve_model")
	cost, _ := repl.Get("teamserve_cost")
	if err != nil || model != "m" || cost != (Cost{6, 2, 3, "prompt"}) || string(got) != body {
		t.Fatalf("error %v, model %v, cost %v, body %q", err, model, cost, got)
	}
	if reader.read != len(body) {
		t.Fatalf("read %d bytes from the client for a %d-byte body", reader.read, len(body))
	}
}

func TestRequestCostBodyLimits(t *testing.T) {
	c := newRequestCost(t, 64)
	body := `{"prompt":["` + strings.Repeat("x", 100) + `"]}`
	r, repl := costRequest("/v1/completions", body, true)
	err := c.ServeHTTP(httptest.NewRecorder(), r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		t.Error("forwarded a body over max_size")
		return nil
	}))
	if statusOf(err) != http.StatusRequestEntityTooLarge || !strings.Contains(err.Error(), "request_cost: request body larger than 64 bytes") {
		t.Fatalf("error %v, want 413", err)
	}
	if v, _ := repl.Get("teamserve_cost"); v != unitCost {
		t.Fatalf("after a refusal the cost is %v, want 1", v)
	}
	r, _ = costRequest("/v1/completions", "{}", true)
	r.Body = failingReader{io.ErrUnexpectedEOF}
	if err := c.ServeHTTP(httptest.NewRecorder(), r, nil); statusOf(err) != http.StatusBadRequest {
		t.Fatalf("truncated body: %v, want 400", err)
	}
}

func TestRequestCostCaddyfile(t *testing.T) {
	for in, want := range map[string]RequestCost{
		"request_cost {teamserve_cost}":                   {Destination: "{teamserve_cost}"},
		"request_cost {c} {\n max_size 2097152\n}":        {Destination: "{c}", MaxSize: 2097152},
		"request_cost {http.vars.cost} {\n max_size 1\n}": {Destination: "{http.vars.cost}", MaxSize: 1},
	} {
		c := new(RequestCost)
		if err := c.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil || c.Destination != want.Destination || c.MaxSize != want.MaxSize {
			t.Errorf("%q: got %+v, %v", in, c, err)
		}
	}
	for in, errPart := range map[string]string{
		"request_cost":                         "takes one destination placeholder, e.g. {teamserve_cost}, got 0",
		"request_cost {a} {b}":                 "got 2 values",
		"request_cost cost":                    `destination "cost" must be one placeholder in braces`,
		"request_cost {c} {\n max_size 0\n}":   `max_size "0" must be a whole number of bytes`,
		"request_cost {c} {\n max_size\n}":     "wrong argument count",
		"request_cost {c} {\n max_size 1 2\n}": "wrong argument count",
		"request_cost {c} {\n per_prompt 2\n}": `unknown request_cost option "per_prompt"`,
	} {
		if err := new(RequestCost).UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err == nil || !strings.Contains(err.Error(), errPart) {
			t.Errorf("%q: want an error with %q, got %v", in, errPart, err)
		}
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for _, c := range []RequestCost{{}, {Destination: "cost"}, {Destination: "{c}", MaxSize: -1}} {
		if err := c.Provision(ctx); err == nil {
			t.Errorf("%+v: want a provisioning error", c)
		}
	}
}

// Outside a route block the three directives are ordered request_body, request_cost, ...,
// inflight_limit, request_priority, reverse_proxy, whatever order the site block lists them in.
func TestCostAndPriorityDirectiveOrder(t *testing.T) {
	input := `:8080 {
	reverse_proxy 10.0.0.1:8000
	request_priority {
		share 2
	}
	inflight_limit {
		key {teamserve_user}
		limit 4
		cost {teamserve_cost}
	}
	request_cost {teamserve_cost}
	request_body {
		max_size 1MB
	}
}`
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := string(out)
	last := -1
	for _, handler := range []string{"request_body", "request_cost", "inflight_limit", "request_priority", "reverse_proxy"} {
		at := strings.Index(s, `"handler":"`+handler+`"`)
		if at < 0 || at < last {
			t.Fatalf("want %s after the handlers before it: %s", handler, s)
		}
		last = at
	}
}

// BenchmarkRequestCost: counting a 2 MiB completions body of short prompts (go test -bench RequestCost -run '^$').
func BenchmarkRequestCost(b *testing.B) {
	var sb strings.Builder
	sb.WriteString(`{"model":"m","n":2,"prompt":[`)
	for i := 0; sb.Len() < 2<<20; i++ {
		if i > 0 {
			sb.WriteByte(',')
		}
		fmt.Fprintf(&sb, `"prompt %d"`, i)
	}
	sb.WriteString(`]}`)
	body := []byte(sb.String())
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := requestCost("/v1/completions", body); err != nil {
			b.Fatal(err)
		}
	}
}

// referenceCost is the plain reading of the cost rules with encoding/json (for RFC 8259 bodies):
// the sequences, or the param and code of the refusal. n's own arithmetic is countN's; what this
// checks is which members count (last of repeated names, escaped names) and the prompt shapes.
func referenceCost(path string, body []byte) (int, string, string) {
	var m map[string]json.RawMessage
	if json.Unmarshal(body, &m) != nil || m == nil {
		return 1, "", ""
	}
	n := 1
	if path == "/v1/chat/completions" || path == "/v1/completions" {
		if raw, ok := m["n"]; ok {
			var err *costError
			if n, err = countN(raw); err != nil {
				return 0, err.param, err.code
			}
		}
	}
	count := func(field string, list bool) (int, string) {
		var v any
		d := json.NewDecoder(bytes.NewReader(m[field]))
		d.UseNumber()
		if raw, ok := m[field]; !ok || string(raw) == "null" || d.Decode(&v) != nil {
			return 0, ""
		}
		entries, isList := v.([]any)
		switch {
		case !isList:
			if _, ok := v.(string); ok {
				return 1, ""
			}
			return 0, field
		case len(entries) == 0:
			return 0, ""
		}
		kinds := map[string]bool{}
		for _, e := range entries {
			switch e := e.(type) {
			case string:
				kinds["s"] = true
			case json.Number:
				kinds["n"] = true
			case []any:
				kinds["l"] = true
				for _, tok := range e {
					if _, ok := tok.(json.Number); !ok {
						return 0, field
					}
				}
			default:
				return 0, field
			}
		}
		switch {
		case len(kinds) != 1:
			return 0, field
		case !list && !kinds["s"]:
			return 0, field
		case kinds["n"]:
			return 1, ""
		}
		return len(entries), ""
	}
	prompts := 1
	switch path {
	case "/v1/completions":
		texts, bad := count("prompt", true)
		if bad != "" {
			return 0, bad, CodeInvalidType
		}
		embeds, bad := count("prompt_embeds", false)
		if bad != "" {
			return 0, bad, CodeInvalidType
		}
		prompts = max(1, texts+embeds)
	case "/v1/embeddings":
		inputs, bad := count("input", true)
		if bad != "" {
			return 0, bad, CodeInvalidType
		}
		prompts = max(1, inputs)
	}
	return int(min(int64(n)*int64(prompts), MaxCost)), "", ""
}

// FuzzRequestCost checks the in-place walk against referenceCost (go test runs the seeds; go test
// -fuzz FuzzRequestCost explores further).
func FuzzRequestCost(f *testing.F) {
	for _, seed := range []string{
		`{"prompt":["a","b"],"n":2}`, `{"prompt":[1,2],"n":3}`, `{"prompt":[[1],[2,3]]}`, `{"prompt":["a",1]}`,
		`{"prompt":[[1,[2]]]}`, `{"n":1,"n":4}`, `{"\u006e":4,"pr\u006fmpt":["a","b"]}`, `{"n":"2"}`, `{"n":0}`,
		`{"n":2.0}`, `{"n":1.5}`, `{"prompt_embeds":["a","b"],"prompt":"c"}`, `{"prompt_embeds":[1]}`,
		`{"input":["a","b","c"]}`, `{"input":[[1,2],[]]}`, `{"prompt":[]}`, `{"prompt":null,"n":null}`,
		`{"messages":[{"n":9}],"x":{"prompt":["a","b"]}}`, `[1]`, `{"prompt":["\"],[","b"]}`,
	} {
		for _, path := range []string{"/v1/completions", "/v1/chat/completions", "/v1/embeddings"} {
			f.Add(path, []byte(seed))
		}
	}
	f.Fuzz(func(t *testing.T, path string, body []byte) {
		if !json.Valid(body) || !utf8Valid(body) {
			return
		}
		cost, err := requestCost(path, body)
		sequences, param, code := referenceCost(path, body)
		if !costedPaths[path] {
			return // requestCost is only called for these
		}
		if err != nil {
			if err.param != param || err.code != code {
				t.Fatalf("%s %q: refused (%s, %s: %s), reference (%q, %q)", path, body, err.param, err.code, err.message, param, code)
			}
			return
		}
		if param != "" || cost.Sequences != sequences {
			t.Fatalf("%s %q: cost %+v, reference %d (refusal %q)", path, body, cost, sequences, param)
		}
	})
}

func utf8Valid(b []byte) bool { return strings.ToValidUTF8(string(b), "\uFFFD") == string(b) }
