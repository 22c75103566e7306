package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/requestbody"
)

// newRequestModel provisions a handler setting {teamserve_model}, with maxSize (0 = the default).
func newRequestModel(t *testing.T, maxSize int64) *RequestModel {
	t.Helper()
	m := &RequestModel{Destination: "{teamserve_model}", MaxSize: maxSize}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := m.Provision(ctx); err != nil {
		t.Fatalf("provision: %v", err)
	}
	return m
}

// modelRequest builds a request with body (nil: none) and Content-Type contentType ("" = none). With
// chunked, the body's length is unknown (ContentLength -1), as for a chunked upload.
func modelRequest(method, contentType string, body []byte, chunked bool) *http.Request {
	var reader io.Reader
	if body != nil {
		reader = bytes.NewReader(body)
	}
	r := httptest.NewRequest(method, "/v1/chat/completions", reader)
	if chunked {
		r.Body = io.NopCloser(bytes.NewReader(body)) // hides the length from anything that looks
		r.ContentLength = -1
	}
	if contentType != "" {
		r.Header.Set("Content-Type", contentType)
	}
	return r
}

// forwarded is what the next handler saw.
type forwarded struct {
	model         any // the placeholder's value; "<unset>" if not set
	body          []byte
	contentLength int64
}

// runModel runs r through m, with repl (nil: a fresh one), and returns what the next handler saw (nil
// if it was not called) and the handler's error.
func runModel(t *testing.T, m *RequestModel, r *http.Request, repl *caddy.Replacer) (*forwarded, error) {
	t.Helper()
	if repl == nil {
		repl = caddy.NewReplacer()
	}
	r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
	var seen *forwarded
	next := caddyhttp.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) error {
		seen = &forwarded{model: "<unset>", contentLength: r.ContentLength}
		if v, ok := repl.Get("teamserve_model"); ok {
			seen.model = v
		}
		var err error
		if seen.body, err = io.ReadAll(r.Body); err != nil {
			t.Errorf("next handler reading the body: %v", err)
		}
		return r.Body.Close()
	})
	err := m.ServeHTTP(httptest.NewRecorder(), r, next)
	return seen, err
}

// chatBody is an OpenAI chat request of about size bytes whose messages hold what could mislead a
// careless parser: "model" members inside messages and tool calls, escaped quotes and backslashes,
// braces and brackets inside strings, non-ASCII text. json.Marshal sorts the members, so "model" comes
// after the large "messages".
func chatBody(t testing.TB, model string, size int) []byte {
	t.Helper()
	tricky := `He said "model": "evil" \ {"model":"nested"} [1,2] \" } ] é 漢字 ` + "\n\t"
	content := strings.Repeat(tricky, size/len(tricky)+1)[:size]
	body, err := json.Marshal(map[string]any{
		"model": model,
		"messages": []any{
			map[string]any{"role": "system", "content": `{"model": "system-prompt-model"}`},
			map[string]any{"role": "user", "content": content},
			map[string]any{"role": "assistant", "tool_calls": []any{map[string]any{
				"type": "function", "function": map[string]any{"name": "pick", "arguments": `{"model":"tool"}`},
				"model": "inside-a-tool-call"}}},
		},
		"stream":         true,
		"stream_options": map[string]any{"include_usage": true, "model": "not-top-level"},
		"max_tokens":     16,
	})
	if err != nil {
		t.Fatal(err)
	}
	return body
}

func TestRequestModelFromLargeChatBody(t *testing.T) {
	m := newRequestModel(t, 0)
	for _, chunked := range []bool{false, true} {
		body := chatBody(t, "Qwen/Qwen2.5-7B-Instruct", 8<<20)
		if i, j := bytes.Index(body, []byte(`"messages"`)), bytes.Index(body, []byte(`"model":"Qwen`)); i < 0 || j < i {
			t.Fatalf("the test body should have model after messages")
		}
		seen, err := runModel(t, m, modelRequest(http.MethodPost, "application/json", body, chunked), nil)
		if err != nil || seen == nil {
			t.Fatalf("chunked=%v: error %v, next called %v", chunked, err, seen != nil)
		}
		if seen.model != "Qwen/Qwen2.5-7B-Instruct" {
			t.Errorf("chunked=%v: model %q", chunked, seen.model)
		}
		if !bytes.Equal(seen.body, body) {
			t.Errorf("chunked=%v: the forwarded body differs from the client's (%d bytes, sent %d)", chunked, len(seen.body), len(body))
		}
		want := int64(len(body))
		if chunked {
			want = -1
		}
		if seen.contentLength != want {
			t.Errorf("chunked=%v: ContentLength %d, want %d", chunked, seen.contentLength, want)
		}
	}
	// Model first, before a large prompt, as most clients write it.
	body := []byte(`{"model":"llama","stream":true,"messages":[{"role":"user","content":"` +
		strings.Repeat("x", 1<<20) + `"}]}`)
	if seen, err := runModel(t, m, modelRequest(http.MethodPost, "application/json", body, false), nil); err != nil ||
		seen.model != "llama" || !bytes.Equal(seen.body, body) {
		t.Fatalf("model first: %v, %+v", err, seen.model)
	}
}

// Bodies without a usable top-level "model" string give "", and are forwarded as they came.
func TestRequestModelEmptyWhenAbsent(t *testing.T) {
	m := newRequestModel(t, 0)
	cases := []struct {
		name, method, contentType, body string
	}{
		{"no model", "POST", "application/json", `{"messages":[{"role":"user","content":"hi"}]}`},
		{"model only nested", "POST", "application/json", `{"input":{"model":"m"},"x":[{"model":"m"}]}`},
		{"model a number", "POST", "application/json", `{"model":7}`},
		{"model null", "POST", "application/json", `{"model":null}`},
		{"model an object", "POST", "application/json", `{"model":{"name":"m"}}`},
		{"model an array", "POST", "application/json", `{"model":["m"]}`},
		{"a later non-string model", "POST", "application/json", `{"model":"m","model":false}`},
		{"other case", "POST", "application/json", `{"Model":"m","MODEL":"m"}`},
		{"top-level array", "POST", "application/json", `[{"model":"m"}]`},
		{"top-level string", "POST", "application/json", `"model"`},
		{"not JSON", "POST", "application/json", `model=m`},
		{"truncated", "POST", "application/json", `{"model":"m","messages":[`},
		{"trailing data", "POST", "application/json", `{"model":"m"} {"model":"n"}`},
		{"invalid after model", "POST", "application/json", `{"model":"m",}`},
		{"empty body", "POST", "application/json", ``},
		{"whitespace", "POST", "application/json", " \n "},
		{"byte order mark", "POST", "application/json", "\xef\xbb\xbf{\"model\":\"m\"}"},
		{"form", "POST", "application/x-www-form-urlencoded", `{"model":"m"}`},
		{"plain text", "POST", "text/plain", `{"model":"m"}`},
		{"json-like type", "POST", "application/jsonl", `{"model":"m"}`},
		{"no content type", "POST", "", `{"model":"m"}`},
	}
	for _, c := range cases {
		for _, chunked := range []bool{false, true} {
			seen, err := runModel(t, m, modelRequest(c.method, c.contentType, []byte(c.body), chunked), nil)
			if err != nil || seen == nil {
				t.Errorf("%s: error %v, next called %v", c.name, err, seen != nil)
				continue
			}
			if seen.model != "" || string(seen.body) != c.body {
				t.Errorf("%s (chunked=%v): model %q, body %q; want \"\" and the body as sent", c.name, chunked, seen.model, seen.body)
			}
		}
	}
	for _, method := range []string{http.MethodGet, http.MethodHead, http.MethodDelete, http.MethodOptions} {
		seen, err := runModel(t, m, modelRequest(method, "application/json", nil, false), nil)
		if err != nil || seen == nil || seen.model != "" || len(seen.body) != 0 {
			t.Errorf("%s without a body: %v, %+v", method, err, seen)
		}
	}
}

// Member names and values are read as the engine (Python's json) reads them.
func TestRequestModelReadsJSONLikeTheEngine(t *testing.T) {
	m := newRequestModel(t, 0)
	for _, c := range []struct{ contentType, body, want string }{
		{"application/json", `{"model":"m"}`, "m"},
		{"application/json; charset=utf-8", `{"model":"m"}`, "m"},
		{"Application/JSON ;charset=UTF-8", `{"model":"m"}`, "m"},
		{"application/json", " \r\n\t{ \"stream\" : true , \"model\" :\n\"m\" } \n", "m"},
		{"application/json", `{"mod\u0065l":"m"}`, "m"},
		{"application/json", `{"model":"org\/name \"q\" \u00e9\ud83d\ude00"}`, "org/name \"q\" é😀"},
		{"application/json", `{"model":"a","model":"b"}`, "b"}, // the last of repeated names
		{"application/json", `{"model":1,"model":"b"}`, "b"},
		{"application/json", `{"model":""}`, ""},
		{"application/json", `{"a\\":"x","model":"m"}`, "m"},                 // a name ending in an escaped backslash
		{"application/json", `{"a":"\\\"model\\\":\"x\"","model":"m"}`, "m"}, // escaped quotes inside a value
		{"application/json", `{"n":-1.5e3,"t":true,"f":false,"z":null,"o":{},"l":[],"model":"m"}`, "m"},
	} {
		seen, err := runModel(t, m, modelRequest(http.MethodPost, c.contentType, []byte(c.body), false), nil)
		if err != nil || seen == nil || seen.model != c.want {
			t.Errorf("%s %s: got %+v, %v; want %q", c.contentType, c.body, seen, err, c.want)
		}
	}
}

// A value planted earlier (a client cannot set a placeholder, but another handler could have) never
// survives: the placeholder is set on every request, refused ones included.
func TestRequestModelIsSetOnEveryRequest(t *testing.T) {
	m := newRequestModel(t, 64)
	planted := func() *caddy.Replacer {
		repl := caddy.NewReplacer()
		repl.Set("teamserve_model", "planted")
		return repl
	}
	if seen, _ := runModel(t, m, modelRequest(http.MethodGet, "", nil, false), planted()); seen == nil || seen.model != "" {
		t.Fatalf("GET: %+v", seen)
	}
	if seen, _ := runModel(t, m, modelRequest(http.MethodPost, "application/json", []byte("[]"), false), planted()); seen == nil || seen.model != "" {
		t.Fatalf("JSON without a model: %+v", seen)
	}
	repl := planted()
	if _, err := runModel(t, m, modelRequest(http.MethodPost, "application/json", bytes.Repeat([]byte(" "), 65), false), repl); err == nil {
		t.Fatal("want a 413")
	}
	if v, _ := repl.Get("teamserve_model"); v != "" {
		t.Fatalf("after a refusal the placeholder is %q, want \"\"", v)
	}
}

// countingReader counts what is read from it and can refuse to be read at all.
type countingReader struct {
	r      io.Reader
	read   int
	forbid bool
}

func (c *countingReader) Read(p []byte) (int, error) {
	if c.forbid {
		return 0, errors.New("read a body that should have been refused unread")
	}
	n, err := c.r.Read(p)
	c.read += n
	return n, err
}

func (c *countingReader) Close() error { return nil }

func statusOf(err error) int {
	var he caddyhttp.HandlerError
	if errors.As(err, &he) {
		return he.StatusCode
	}
	return 0
}

func TestRequestModelRefusesBodiesOverItsLimit(t *testing.T) {
	const limit = 1024
	m := newRequestModel(t, limit)
	body := []byte(`{"model":"m","prompt":"` + strings.Repeat("x", 2000) + `"}`)

	// Declared too large: refused before anything is read.
	r := modelRequest(http.MethodPost, "application/json", body, false)
	r.Body = &countingReader{forbid: true}
	if seen, err := runModel(t, m, r, nil); statusOf(err) != http.StatusRequestEntityTooLarge || seen != nil {
		t.Fatalf("declared %d bytes: error %v, next called %v; want 413 and not called", len(body), err, seen != nil)
	} else if !strings.Contains(err.Error(), "larger than 1024 bytes") {
		t.Fatalf("error %q should give the limit", err)
	}

	// Length unknown: refused once limit+1 bytes are in, without reading the rest.
	reader := &countingReader{r: bytes.NewReader(body)}
	r = modelRequest(http.MethodPost, "application/json", body, true)
	r.Body = reader
	if seen, err := runModel(t, m, r, nil); statusOf(err) != http.StatusRequestEntityTooLarge || seen != nil {
		t.Fatalf("chunked %d bytes: error %v; want 413", len(body), err)
	}
	if reader.read != limit+1 {
		t.Fatalf("read %d bytes of a too-large body, want %d", reader.read, limit+1)
	}

	// Exactly the limit passes, either way.
	exact := append([]byte(`{"model":"m","p":"`), bytes.Repeat([]byte("y"), limit-20)...)
	exact = append(exact, `"}`...)
	for _, chunked := range []bool{false, true} {
		if seen, err := runModel(t, m, modelRequest(http.MethodPost, "application/json", exact, chunked), nil); err != nil ||
			seen.model != "m" || !bytes.Equal(seen.body, exact) {
			t.Fatalf("a body of exactly the limit (chunked=%v): %v", chunked, err)
		}
	}

	// The default is 64 MiB: a body declared one byte over is refused unread.
	m = newRequestModel(t, 0)
	if m.MaxSize != DefaultModelBodyMax || DefaultModelBodyMax != 64<<20 {
		t.Fatalf("default max_size %d", m.MaxSize)
	}
	r = modelRequest(http.MethodPost, "application/json", []byte("{}"), false)
	r.Body, r.ContentLength = &countingReader{forbid: true}, DefaultModelBodyMax+1
	if _, err := runModel(t, m, r, nil); statusOf(err) != http.StatusRequestEntityTooLarge {
		t.Fatalf("64 MiB + 1 declared: %v, want 413", err)
	}
	// Other content types are not read, whatever their size.
	r = modelRequest(http.MethodPost, "application/octet-stream", []byte("{}"), false)
	r.Body, r.ContentLength = &countingReader{forbid: true}, DefaultModelBodyMax+1
	r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
	called := false
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { called = true; return nil })
	if err := m.ServeHTTP(httptest.NewRecorder(), r, next); err != nil || !called {
		t.Fatalf("octet-stream: error %v, next called %v; want it passed on unread", err, called)
	}
}

// After request_body, its max_size error comes through unchanged (its 413 and the gateway's message
// for it), whether the length was declared or not.
func TestRequestModelAfterRequestBody(t *testing.T) {
	m := newRequestModel(t, 0)
	limiter := requestbody.RequestBody{MaxSize: 100}
	body := chatBody(t, "m", 500)
	for _, chunked := range []bool{false, true} {
		r := modelRequest(http.MethodPost, "application/json", body, chunked)
		r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
		called := false
		next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { called = true; return nil })
		err := limiter.ServeHTTP(httptest.NewRecorder(), r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			return m.ServeHTTP(w, r, next)
		}))
		var maxBytes *http.MaxBytesError
		if statusOf(err) != http.StatusRequestEntityTooLarge || !errors.As(err, &maxBytes) || maxBytes.Limit != 100 || called {
			t.Fatalf("chunked=%v: error %v, next called %v; want request_body's 413", chunked, err, called)
		}
	}
	// Within the limit, the body read through request_body's reader reaches the next handler whole.
	small := []byte(`{"model":"m"}`)
	r := modelRequest(http.MethodPost, "application/json", small, true)
	repl := caddy.NewReplacer()
	r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
	var got []byte
	err := limiter.ServeHTTP(httptest.NewRecorder(), r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		return m.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) error {
			got, _ = io.ReadAll(r.Body)
			return nil
		}))
	}))
	if v, _ := repl.Get("teamserve_model"); err != nil || v != "m" || !bytes.Equal(got, small) {
		t.Fatalf("within request_body's limit: %v, model %v, body %q", err, v, got)
	}
}

type failingReader struct{ err error }

func (f failingReader) Read([]byte) (int, error) { return 0, f.err }
func (f failingReader) Close() error             { return nil }

type timeoutError struct{}

func (timeoutError) Error() string   { return "i/o timeout" }
func (timeoutError) Timeout() bool   { return true }
func (timeoutError) Temporary() bool { return true }

func TestRequestModelReadFailures(t *testing.T) {
	m := newRequestModel(t, 0)
	for _, c := range []struct {
		err  error
		want int
	}{
		{io.ErrUnexpectedEOF, http.StatusBadRequest},
		{fmt.Errorf("read tcp: %w", timeoutError{}), http.StatusRequestTimeout},
		{&http.MaxBytesError{Limit: 10}, http.StatusRequestEntityTooLarge},
		{caddyhttp.Error(http.StatusTeapot, errors.New("earlier handler")), http.StatusTeapot},
	} {
		r := modelRequest(http.MethodPost, "application/json", []byte("{}"), true)
		r.Body = failingReader{c.err}
		if seen, err := runModel(t, m, r, nil); statusOf(err) != c.want || seen != nil {
			t.Errorf("%v: error %v, next called %v; want %d", c.err, err, seen != nil, c.want)
		}
	}
}

// The buffer is sized by what arrives: a declared length reserves nothing by itself, a declared body
// is held in one right-sized buffer, and a chunked one in at most a quarter (or 4 KiB) more than its
// size.
func TestReadBodyMemory(t *testing.T) {
	for _, size := range []int{0, 1, 511, 512, 513, 64 << 10, 1<<20 + 7} {
		body := bytes.Repeat([]byte("z"), size)
		declared, err := readBody(bytes.NewReader(body), int64(size), 64<<20)
		if err != nil || !bytes.Equal(declared, body) {
			t.Fatalf("%d declared: %v", size, err)
		}
		if size > 0 && cap(declared) > size+1 {
			t.Errorf("%d declared: buffer of %d", size, cap(declared))
		}
		chunked, err := readBody(bytes.NewReader(body), -1, 64<<20)
		if err != nil || !bytes.Equal(chunked, body) {
			t.Fatalf("%d chunked: %v", size, err)
		}
		if slack := cap(chunked) - len(chunked); slack > 4096 && slack > len(chunked)/4 {
			t.Errorf("%d chunked: buffer of %d", size, cap(chunked))
		}
	}
	// 10 bytes sent of 60 MiB declared (the client stops, or lies): a small buffer.
	short, err := readBody(bytes.NewReader([]byte("0123456789")), 60<<20, 64<<20)
	if err != nil || string(short) != "0123456789" || cap(short) > 64<<10 {
		t.Fatalf("short body: %q, buffer %d, %v", short, cap(short), err)
	}
}

// referenceModel is the plain reading of the rule with encoding/json: the "model" member (exact name,
// the last if repeated) of a top-level object, if it is a string.
func referenceModel(doc []byte) string {
	var members map[string]json.RawMessage
	if json.Unmarshal(doc, &members) != nil {
		return ""
	}
	raw, ok := members["model"]
	if !ok || len(raw) == 0 || raw[0] != '"' {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return ""
	}
	return s
}

// FuzzModelField checks the in-place walk against encoding/json (go test runs the seeds; go test -fuzz
// FuzzModelField explores further).
func FuzzModelField(f *testing.F) {
	for _, seed := range []string{
		`{"model":"m"}`, `{"model":"a","model":"b"}`, `{"mod\u0065l":"m"}`, `{"Model":"m"}`, `{"model":1}`,
		`{"a":{"model":"x"},"model":"m"}`, `{"a":"\\","model":"m"}`, `{"a":"\\\"","model":"m"}`,
		`{"a":[{"b":"}"},"]"],"model":"m"}`, `[{"model":"m"}]`, `{"model":"m"`, `{"model":"m"}x`,
		`{"model":"\ud800"}`, "{\"model\":\"\xff\"}", `{"model":"é\n\"x\""}`, ` { } `, `null`, ``,
		`{"x":-0.0e+1,"y":true,"z":null,"model":"m"}`, `{"model" : "m" , "model" : null}`,
	} {
		f.Add([]byte(seed))
	}
	f.Add(chatBody(f, "big", 4096))
	f.Fuzz(func(t *testing.T, doc []byte) {
		if got, want := modelField(doc), referenceModel(doc); got != want {
			t.Fatalf("%q: got %q, encoding/json gives %q", doc, got, want)
		}
	})
}

func TestRequestModelCaddyfile(t *testing.T) {
	for in, want := range map[string]RequestModel{
		"request_model {teamserve_model}":                          {Destination: "{teamserve_model}"},
		"request_model {model} {\n max_size 2097152\n}":            {Destination: "{model}", MaxSize: 2097152},
		"request_model {http.vars.model} {\n max_size 1 # tiny\n}": {Destination: "{http.vars.model}", MaxSize: 1},
	} {
		m := new(RequestModel)
		if err := m.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil || m.Destination != want.Destination ||
			m.MaxSize != want.MaxSize {
			t.Errorf("%q: got %+v, %v", in, m, err)
		}
	}
	for in, errPart := range map[string]string{
		"request_model":                                          "takes one destination placeholder, e.g. {teamserve_model}, got 0",
		"request_model {a} {b}":                                  "got 2 values",
		"request_model teamserve_model":                          `destination "teamserve_model" must be one placeholder in braces`,
		"request_model {a}{b}":                                   "must be one placeholder",
		"request_model {}":                                       "must be one placeholder",
		"request_model {m} {\n max_size\n}":                      "wrong argument count",
		"request_model {m} {\n max_size 2MiB\n}":                 `max_size "2MiB" must be a whole number of bytes`,
		"request_model {m} {\n max_size 0\n}":                    `max_size "0"`,
		"request_model {m} {\n max_size 10 20\n}":                "wrong argument count",
		"request_model {m} {\n field model\n}":                   `unknown request_model option "field"`,
		"request_model {m} {\n max_size 10\n max_size x\n}":      `max_size "x"`,
		"request_model {m} {\n max_size -5\n}":                   `max_size "-5"`,
		"request_model {m} {\n max_size 99999999999999999999\n}": "must be a whole number",
	} {
		if err := new(RequestModel).UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err == nil ||
			!strings.Contains(err.Error(), errPart) {
			t.Errorf("%q: want an error with %q, got %v", in, errPart, err)
		}
	}
}

func TestRequestModelValidation(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	for _, c := range []struct {
		m       RequestModel
		errPart string
	}{
		{RequestModel{}, `destination "" must be one placeholder`},
		{RequestModel{Destination: "model"}, `destination "model" must be one placeholder`},
		{RequestModel{Destination: "{a b}"}, `destination "{a b}"`},
		{RequestModel{Destination: "{m}", MaxSize: -1}, "max_size -1 must be >= 1"},
	} {
		if err := c.m.Provision(ctx); err == nil || !strings.Contains(err.Error(), c.errPart) {
			t.Errorf("%+v: want an error with %q, got %v", c.m, c.errPart, err)
		}
	}
}

// The Caddyfile of a front gateway: request_model in a route, then a `vars` matcher on the placeholder
// it sets; the handler comes first and the matcher reads the placeholder by its braces.
func TestRequestModelCaddyfileAdapts(t *testing.T) {
	input := `:8080 {
	route {
		request_model {teamserve_model}
		@x vars {teamserve_model} x
		respond @x "model x"
		respond "other"
	}
}`
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := string(out)
	handler := strings.Index(s, `{"destination":"{teamserve_model}","handler":"request_model"}`)
	matcher := strings.Index(s, `"vars":{"{teamserve_model}":["x"]}`)
	if handler < 0 || matcher < 0 || handler > matcher {
		t.Fatalf("want the request_model handler, then the vars matcher: %s", s)
	}
}

// Outside a route, the directive is ordered after request_body (which bounds its read) and before the
// handlers that match on it, whatever order the site block lists them in.
func TestRequestModelDirectiveOrder(t *testing.T) {
	input := `:8080 {
	@x vars {teamserve_model} x
	reverse_proxy @x 10.0.0.1:8000
	respond "other"
	request_model {teamserve_model}
	request_body {
		max_size 1MB
	}
}`
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := string(out)
	body := strings.Index(s, `"handler":"request_body"`)
	model := strings.Index(s, `"handler":"request_model"`)
	if body < 0 || model < body {
		t.Fatalf("want request_body, then request_model: %s", s)
	}
	for _, reader := range []string{`"handler":"reverse_proxy"`, `"handler":"static_response"`} {
		if at := strings.Index(s, reader); at < model {
			t.Fatalf("request_model must come before %s: %s", reader, s)
		}
	}
}

// End to end in Caddy, from a Caddyfile: the placeholder routes the request, the body reaches the
// handler after it byte for byte, and request_body's limit still answers 413.
func TestRequestModelInCaddy(t *testing.T) {
	client := caddyClient(t, `http:// {
	bind unix/{socket}
	request_body {
		max_size 100000
	}
	route {
		request_model {teamserve_model}
		@big vars {teamserve_model} big-model
		respond @big "big {http.request.body}" 200
		respond "other [{teamserve_model}]" 200
	}
}`)
	post := func(contentType, body string) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, "http://gateway/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", contentType)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(out)
	}
	body := string(chatBody(t, "big-model", 50000))
	if code, got := post("application/json", body); code != 200 || got != "big "+body {
		t.Fatalf("big-model: %d, %d bytes; want 200 and the body echoed whole", code, len(got))
	}
	if code, got := post("application/json", `{"model":"small-model"}`); code != 200 || got != "other [small-model]" {
		t.Fatalf("small-model: %d %q", code, got)
	}
	if code, got := post("text/plain", `{"model":"big-model"}`); code != 200 || got != "other []" {
		t.Fatalf("text/plain: %d %q", code, got)
	}
	if code, _ := post("application/json", string(chatBody(t, "big-model", 200000))); code != http.StatusRequestEntityTooLarge {
		t.Fatalf("over request_body's max_size: %d, want 413", code)
	}
}

// BenchmarkModelField: the lookup in a 2 MiB chat body (the default request_body bound for a 32k-token
// context), model last (go test -bench ModelField -run '^$').
func BenchmarkModelField(b *testing.B) {
	body := chatBody(b, "Qwen/Qwen2.5-7B-Instruct", 2<<20)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if modelField(body) != "Qwen/Qwen2.5-7B-Instruct" {
			b.Fatal("model not found")
		}
	}
}
