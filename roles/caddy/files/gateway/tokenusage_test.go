package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
)

// usageEngine answers as vLLM's OpenAI server does: a JSON answer with "usage", or, for "stream": true,
// server-sent events written a few bytes at a time (so events arrive split), with the usage-only chunk
// (empty choices) only when stream_options.include_usage is true, and each other chunk's running
// "usage" when continuous_usage_stats is true as well. It records the bodies it got. On /v1/cut it
// sends the first chunk and then nothing until the client has gone (at most 10 s).
type usageEngine struct {
	*httptest.Server
	bodies chan string
}

const (
	doublePrompt     = 17
	doubleCompletion = 3
)

func newUsageEngine(t *testing.T) *usageEngine {
	e := &usageEngine{bodies: make(chan string, 16)}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		raw, _ := io.ReadAll(r.Body)
		e.bodies <- string(raw)
		req := engineRequest(raw)
		usage := fmt.Sprintf(`{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}`,
			doublePrompt, doublePrompt+doubleCompletion, doubleCompletion)
		switch {
		case r.URL.Path == "/v1/bad":
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"no"},"usage":`+usage+`}`)
		case r.URL.Path == "/v1/responses" && req.Stream:
			w.Header().Set("Content-Type", "text/event-stream")
			writeSlowly(w, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n"+
				"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":"+
				"{\"input_tokens\":11,\"output_tokens\":5,\"total_tokens\":16}}}\n\n")
		case r.URL.Path == "/v1/big": // n 2 with logprobs: megabytes before the usage, written as a proxy passes it on
			w.Header().Set("Content-Type", "application/json")
			writeBig(w, `{"id":"c","choices":[`, `],"usage":`+usage+`}`)
		case r.URL.Path == "/v1/big-usage-first": // the usage, then megabytes of prompt_logprobs after it
			w.Header().Set("Content-Type", "application/json")
			writeBig(w, `{"id":"c","usage":`+usage+`,"prompt_logprobs":[`, `]}`)
		case r.URL.Path == "/v1/responses":
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"object":"response","usage":{"input_tokens":11,"output_tokens":5,"total_tokens":16}}`)
		case req.Stream:
			w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
			running := func(completion int) string { // vLLM's chunk.usage with continuous_usage_stats
				if !req.StreamOptions.IncludeUsage || !req.StreamOptions.Continuous {
					return ""
				}
				return fmt.Sprintf(`,"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}`,
					doublePrompt, doublePrompt+completion, completion)
			}
			first := `data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hel"}}]` + running(1) + "}\n\n"
			if r.URL.Path == "/v1/cut" {
				writeSlowly(w, first)
				select {
				case <-r.Context().Done():
				case <-time.After(10 * time.Second):
				}
				return
			}
			events := first +
				`data: {"id":"c","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]` + running(doubleCompletion) + "}\n\n"
			if req.StreamOptions.IncludeUsage {
				events += `data: {"id":"c","choices":[],"usage":` + usage + "}\n\n"
			}
			writeSlowly(w, events+"data: [DONE]\n\n")
		default:
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"c","choices":[{"index":0,"message":{"content":"Hello"}}],"usage":`+usage+`}`)
		}
	}))
	t.Cleanup(e.Close)
	return e
}

// bigAnswerBytes is the size of the double's large answers: the 7.2 MB seen from the real engine for n 2
// with logprobs (3,212 tokens), well past what a gateway would hold for one answer.
const bigAnswerBytes = 7_200_000

// writeBig writes head, logprob entries up to bigAnswerBytes, then tail, 32 KiB at a time.
func writeBig(w http.ResponseWriter, head, tail string) {
	const entry = `{"token":"\u0120word","logprob":-0.6931471805599453,"bytes":[32,119,111,114,100],"top_logprobs":[]},`
	var b strings.Builder
	b.WriteString(head)
	for b.Len() < bigAnswerBytes {
		b.WriteString(entry)
	}
	b.WriteString(`{"token":"}\"usage\":{\"prompt_tokens\":999}"}`) // a "usage" in a string counts nothing
	b.WriteString(tail)
	for s := b.String(); len(s) > 0; {
		n := min(32<<10, len(s))
		_, _ = io.WriteString(w, s[:n])
		s = s[n:]
	}
}

// engineRequest reads the members the double acts on as vLLM 0.32 does: the last of repeated names, and
// each bool as pydantic read it when testdata/pydantic_bool.json was recorded (anything else: false).
func engineRequest(raw []byte) (req struct {
	Stream        bool
	StreamOptions struct{ IncludeUsage, Continuous bool }
}) {
	var body, options map[string]json.RawMessage
	if json.Unmarshal(raw, &body) != nil {
		return req
	}
	_ = json.Unmarshal(body["stream_options"], &options)
	req.Stream = pydanticBool(body["stream"])
	req.StreamOptions.IncludeUsage = pydanticBool(options["include_usage"])
	req.StreamOptions.Continuous = pydanticBool(options["continuous_usage_stats"])
	return req
}

// pydanticOracle is testdata/pydantic_bool.json: a JSON value sent for a bool -> what pydantic made of it
// (nil: refused).
var pydanticOracle = func() map[string]*bool {
	data, err := os.ReadFile("testdata/pydantic_bool.json")
	if err != nil {
		panic(err)
	}
	var rows []struct {
		JSON string `json:"json"`
		Bool *bool  `json:"bool"`
	}
	if err := json.Unmarshal(data, &rows); err != nil {
		panic(err)
	}
	oracle := map[string]*bool{}
	for _, row := range rows {
		oracle[row.JSON] = row.Bool
	}
	return oracle
}()

func pydanticBool(raw json.RawMessage) bool {
	b := pydanticOracle[string(raw)]
	return b != nil && *b
}

// writeSlowly writes s in pieces of 7 bytes, flushing each, as a stream crosses the network.
func writeSlowly(w http.ResponseWriter, s string) {
	for len(s) > 0 {
		n := min(7, len(s))
		_, _ = io.WriteString(w, s[:n])
		w.(http.Flusher).Flush()
		s = s[n:]
	}
}

// usageGateway runs token_usage (with the options given, if any) before reverse_proxy to engine in a real
// Caddy with a JSON access log.
func usageGateway(t *testing.T, engine *usageEngine, options ...string) (*http.Client, string) {
	t.Helper()
	dir := t.TempDir()
	logPath := filepath.Join(dir, "access.log")
	block := ""
	if len(options) > 0 {
		block = "{\n\t\t\t" + strings.ReplaceAll(strings.Join(options, "\n"), "{dir}", dir) + "\n\t\t}"
	}
	client, _ := frontGateway(t, fmt.Sprintf(`http:// {
	bind unix/{socket}
	log {
		output file %s
		format json
	}
	route {
		token_usage %s
		reverse_proxy %s {
			flush_interval -1
		}
	}
}`, logPath, block, engine.Listener.Addr().String()))
	return client, logPath
}

func tokensLogged(entry map[string]any) (any, any) {
	return entry[PromptTokensLogField], entry[CompletionTokensLogField]
}

// Chat and completions, streamed or not, log the engine's usage; a stream the client did not ask usage
// for is asked for it, and the usage-only chunk is taken out before the client sees it, every other
// event whole and in order; a client that asked keeps it and its body is forwarded as sent.
func TestTokenUsageLogsTheEnginesCounts(t *testing.T) {
	engine := newUsageEngine(t)
	client, logPath := usageGateway(t, engine)
	cases := []struct {
		id, path, body  string
		wantForwarded   string // "" = the client's body unchanged
		wantUsages      int    // chunks with a "usage" at the client (the usage-only one last)
		wantPrompt      float64
		wantCompletion  float64
		wantEventsCount int
	}{
		{"chat", "/v1/chat/completions", `{"model":"m","messages":[]}`, "", 0, doublePrompt, doubleCompletion, 0},
		{"completions", "/v1/completions", `{"model":"m","prompt":"x","stream":false}`, "", 0, doublePrompt, doubleCompletion, 0},
		{"stream", "/v1/chat/completions", `{"model":"m", "stream": true, "messages":[]}`,
			`{"stream_options":{"continuous_usage_stats":true,"include_usage":true},"model":"m", "stream": true, "messages":[]}`, 0, doublePrompt, doubleCompletion, 3},
		{"stream-options", "/v1/completions", `{"stream":true,"stream_options":{"continuous_usage_stats":false},"prompt":"x"}`,
			`{"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true},"prompt":"x"}`, 0, doublePrompt, doubleCompletion, 3},
		{"stream-continuous-alone", "/v1/completions", `{"stream":true,"stream_options":{"continuous_usage_stats":true},"prompt":"x"}`,
			`{"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true},"prompt":"x"}`, 0, doublePrompt, doubleCompletion, 3},
		{"stream-null-options", "/v1/completions", `{"stream":true,"stream_options":null}`,
			`{"stream":true,"stream_options":{"continuous_usage_stats":true,"include_usage":true}}`, 0, doublePrompt, doubleCompletion, 3},
		{"stream-asked", "/v1/chat/completions", `{"stream":true,"stream_options":{"include_usage":true}}`,
			`{"stream":true,"stream_options":{"continuous_usage_stats":true,"include_usage":true}}`, 1, doublePrompt, doubleCompletion, 4},
		{"stream-asked-both", "/v1/chat/completions", `{"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true}}`,
			"", 3, doublePrompt, doubleCompletion, 4},
		{"responses", "/v1/responses", `{"input":"x"}`, "", 0, 11, 5, 0},
		{"responses-stream", "/v1/responses", `{"input":"x","stream":true,"stream_options":{"include_usage":true}}`,
			`{"input":"x","stream":true,"stream_options":{"continuous_usage_stats":true,"include_usage":true}}`, 1, 11, 5, 2},
	}
	for _, c := range cases {
		t.Run(c.id, func(t *testing.T) {
			got := post(context.Background(), client, "", c.path, c.body, "X-Request-Id", c.id)
			if got.status != http.StatusOK {
				t.Fatalf("answer %d %q", got.status, got.body)
			}
			forwarded := <-engine.bodies
			if want := c.body; c.wantForwarded != "" {
				want = c.wantForwarded
				if forwarded != want {
					t.Fatalf("engine got %s, want %s", forwarded, want)
				}
			} else if forwarded != want {
				t.Fatalf("engine got %s, want the client's %s", forwarded, want)
			}
			if c.wantEventsCount > 0 {
				events := strings.Split(strings.TrimSuffix(got.body, "\n\n"), "\n\n")
				if len(events) != c.wantEventsCount {
					t.Fatalf("client got %d events, want %d: %q", len(events), c.wantEventsCount, got.body)
				}
				if n := strings.Count(got.body, `"usage"`); n != c.wantUsages {
					t.Fatalf("%d chunks with a usage at the client, want %d: %q", n, c.wantUsages, got.body)
				}
				if has := strings.Contains(got.body, `"choices":[],"usage"`); strings.HasPrefix(c.path, "/v1/c") && has != (c.wantUsages > 0) {
					t.Fatalf("usage-only chunk at the client: %v, want %v: %q", has, c.wantUsages > 0, got.body)
				}
				if strings.HasPrefix(c.path, "/v1/c") && !strings.HasSuffix(got.body, "data: [DONE]\n\n") {
					t.Fatalf("stream does not end with [DONE]: %q", got.body)
				}
			}
			prompt, completion := tokensLogged(accessLogEntries(t, logPath, c.id))
			if prompt != c.wantPrompt || completion != c.wantCompletion {
				t.Fatalf("logged prompt %v completion %v, want %v and %v", prompt, completion, c.wantPrompt, c.wantCompletion)
			}
		})
	}
}

// A stream cut before its usage-only chunk (the client hangs up after the first chunk) counts the running
// usage the gateway asked the engine for: the prompt and the tokens sent until then, in the access log and
// in the key's tokens today, so hanging up early does not get around a budget. The client never saw a
// "usage" it did not ask for.
func TestTokenUsageCountsAStreamCutShort(t *testing.T) {
	engine := newUsageEngine(t)
	go func() { // the double's bodies are not read here
		for range engine.bodies {
		}
	}()
	client, logPath := usageGateway(t, engine, "key {http.request.header.X-User}", "ledger {dir}/tokens.json")
	req, _ := http.NewRequest(http.MethodPost, "http://gateway/v1/cut", strings.NewReader(`{"stream":true,"prompt":"x"}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-User", "carol")
	req.Header.Set("X-Request-Id", "cut")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	first := make([]byte, 0, 256)
	buf := make([]byte, 256)
	for !strings.HasSuffix(string(first), "\n\n") {
		n, err := resp.Body.Read(buf)
		first = append(first, buf[:n]...)
		if err != nil {
			t.Fatalf("first chunk: %q, %v", first, err)
		}
	}
	resp.Body.Close() // hang up mid-stream
	if strings.Contains(string(first), "usage") || !strings.Contains(string(first), `"content":"Hel"`) {
		t.Fatalf("first chunk at the client %q, want the content without a usage", first)
	}
	prompt, completion := tokensLogged(accessLogEntries(t, logPath, "cut"))
	if prompt != float64(doublePrompt) || completion != float64(1) {
		t.Fatalf("logged prompt %v completion %v for the cut stream, want %d and 1", prompt, completion, doublePrompt)
	}
	if resp, body := askAs(client, "carol"); resp.Header.Get("X-Teamserve-Tokens-Today") != fmt.Sprint(doublePrompt+1) {
		t.Fatalf("next answer %d %q: tokens today %q, want %d", resp.StatusCode, body,
			resp.Header.Get("X-Teamserve-Tokens-Today"), doublePrompt+1)
	}
}

// An error answer is not counted, even one that carries a "usage"; neither is a request whose body is
// not JSON to the engine (forwarded unchanged).
func TestTokenUsageCountsOnlyServedAnswers(t *testing.T) {
	engine := newUsageEngine(t)
	client, logPath := usageGateway(t, engine)
	if got := post(context.Background(), client, "", "/v1/bad", `{"stream":true}`, "X-Request-Id", "bad"); got.status != http.StatusBadRequest {
		t.Fatalf("answer %d %q, want the engine's 400", got.status, got.body)
	}
	<-engine.bodies
	for _, id := range []string{"bad"} {
		if prompt, completion := tokensLogged(accessLogEntries(t, logPath, id)); prompt != nil || completion != nil {
			t.Fatalf("%s: logged %v and %v, want no token fields", id, prompt, completion)
		}
	}
	invalid := `{"stream":true,` // the engine answers its own 400; here the double answers 200 without usage
	post(context.Background(), client, "", "/v1/chat/completions", invalid, "X-Request-Id", "invalid")
	if forwarded := <-engine.bodies; forwarded != invalid {
		t.Fatalf("an invalid body was changed: %q", forwarded)
	}
}

func TestTokenUsageCaddyfile(t *testing.T) {
	for _, bad := range []string{"token_usage extra", "token_usage {\n max_size 0\n}", "token_usage {\n max_answer 20\n}",
		"token_usage {\n colour red\n}", "token_usage {\n tokens_per_minute\n}"} {
		if _, err := parseTokenUsage(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
	u, err := parseTokenUsage("token_usage {\n max_size 10\n}")
	if err != nil || u.MaxSize != 10 {
		t.Fatalf("%+v %v", u, err)
	}
}

func parseTokenUsage(text string) (*TokenUsage, error) {
	u := new(TokenUsage)
	return u, u.UnmarshalCaddyfile(caddyfile.NewTestDispenser(text))
}

// budgetGateway is usageGateway with a ledger and a daily budget per X-User.
func budgetGateway(t *testing.T, engine *usageEngine, ledger string, budget string) *http.Client {
	t.Helper()
	return budgetsGateway(t, engine, ledger, "tokens_per_day "+budget)
}

// budgetsGateway is usageGateway with a ledger per X-User and the budget options given.
func budgetsGateway(t *testing.T, engine *usageEngine, ledger string, options string) *http.Client {
	t.Helper()
	client, _ := frontGateway(t, fmt.Sprintf(`http:// {
	bind unix/{socket}
	route {
		token_usage {
			key {http.request.header.X-User}
			ledger %s
			%s
		}
		reverse_proxy %s
	}
}`, ledger, options, engine.Listener.Addr().String()))
	return client
}

func askAs(client *http.Client, user string) (*http.Response, string) {
	req, _ := http.NewRequest(http.MethodPost, "http://gateway/v1/chat/completions", strings.NewReader(`{"messages":[]}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-User", user)
	resp, err := client.Do(req)
	if err != nil {
		return &http.Response{StatusCode: 0, Header: http.Header{}}, err.Error()
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp, string(body)
}

// A key past its daily budget gets 429 token_budget_exceeded naming the budget and the reset, with
// Retry-After until 00:00 UTC, while another key is served; each answer says the key's tokens today;
// the counts survive a stop and a new start of the gateway (the ledger file).
func TestTokenBudgetRefusesOnlyTheKeyPastIt(t *testing.T) {
	engine := newUsageEngine(t)
	go func() { // the double's bodies are not read here
		for range engine.bodies {
		}
	}()
	ledger := filepath.Join(t.TempDir(), "tokens.json")
	client := budgetGateway(t, engine, ledger, "{http.request.header.X-Budget}45")
	perAnswer := doublePrompt + doubleCompletion // 20
	for i, want := range []int{0, perAnswer, 2 * perAnswer} {
		resp, body := askAs(client, "alice")
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Teamserve-Tokens-Today") != fmt.Sprint(want) ||
			resp.Header.Get("X-Teamserve-Tokens-Per-Day") != "45" {
			t.Fatalf("answer %d: %d %q, tokens today %q of %q, want 200 with %d of 45", i, resp.StatusCode, body,
				resp.Header.Get("X-Teamserve-Tokens-Today"), resp.Header.Get("X-Teamserve-Tokens-Per-Day"), want)
		}
	}
	resp, body := askAs(client, "alice") // 60 used >= 45
	var refusal openAIError
	_ = json.Unmarshal([]byte(body), &refusal)
	if resp.StatusCode != http.StatusTooManyRequests || refusal.Error.Code != TokenBudgetCode || refusal.Error.Type != "tokens" ||
		!strings.Contains(refusal.Error.Message, "used 60 of its 45 tokens") || !strings.Contains(refusal.Error.Message, "T00:00:00Z") {
		t.Fatalf("past the budget: %d %q, want 429 %s naming 60 of 45 and the reset", resp.StatusCode, body, TokenBudgetCode)
	}
	if wait, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || wait < 1 || wait > 86400 {
		t.Fatalf("Retry-After %q, want the seconds until 00:00 UTC", resp.Header.Get("Retry-After"))
	}
	if resp, body := askAs(client, "bob"); resp.StatusCode != http.StatusOK {
		t.Fatalf("another key: %d %q, want 200", resp.StatusCode, body)
	}

	// Stop: the last config's Cleanup writes the file; a new gateway on the same ledger refuses alice.
	if err := caddy.Stop(); err != nil {
		t.Fatal(err)
	}
	var saved ledgerFile
	data, _ := os.ReadFile(ledger)
	if err := json.Unmarshal(data, &saved); err != nil || saved.Tokens["alice"] != int64(3*perAnswer) ||
		saved.Tokens["bob"] != int64(perAnswer) || saved.Day != utcDay(time.Now()) {
		t.Fatalf("ledger after the stop: %s (%v)", data, err)
	}
	client = budgetGateway(t, engine, ledger, "45")
	if resp, body := askAs(client, "alice"); resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("after a restart: %d %q, want the budget still used", resp.StatusCode, body)
	}
	if resp, _ := askAs(client, "bob"); resp.StatusCode != http.StatusOK || resp.Header.Get("X-Teamserve-Tokens-Today") != fmt.Sprint(perAnswer) {
		t.Fatalf("bob after a restart: %d, tokens today %q, want 200 and %d", resp.StatusCode, resp.Header.Get("X-Teamserve-Tokens-Today"), perAnswer)
	}
}

// The day's counts start again at 00:00 UTC; a file of another day or a broken one starts from zero.
func TestTokenLedgerDays(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "tokens.json")
	clock := time.Date(2026, 12, 5, 23, 59, 30, 0, time.UTC)
	now := func() time.Time { return clock }
	l := loadLedger(path, zap.NewNop(), now)
	l.add("alice", 100)
	if used, reset := l.used("alice"); used != 100 || !reset.Equal(time.Date(2026, 12, 6, 0, 0, 0, 0, time.UTC)) {
		t.Fatalf("used %d reset %v", used, reset)
	}
	l.flush()
	if again := loadLedger(path, zap.NewNop(), now); again.tokens["alice"] != 100 {
		t.Fatalf("reloaded the same day: %v", again.tokens)
	}
	clock = clock.Add(time.Minute) // 00:00:30 the next day
	if used, _ := l.used("alice"); used != 0 {
		t.Fatalf("after midnight: %d, want 0", used)
	}
	if again := loadLedger(path, zap.NewNop(), now); len(again.tokens) != 0 {
		t.Fatalf("yesterday's file: %v, want nothing", again.tokens)
	}
	_ = os.WriteFile(path, []byte("{not json"), 0o600)
	if broken := loadLedger(path, zap.NewNop(), now); len(broken.tokens) != 0 || broken.day != "2026-12-06" {
		t.Fatalf("broken file: %+v", broken)
	}
	_ = l.Destruct()
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Fatalf("files left: %v, want only the ledger", entries)
	}
}

// A key whose answers of the last minute used its tokens_per_minute gets 429 tokens_per_minute_exceeded
// with Retry-After within the minute, its daily count untouched by the refusal; another key is served.
func TestTokensPerMinuteRefusesOnlyTheKeyPastIt(t *testing.T) {
	engine := newUsageEngine(t)
	go func() {
		for range engine.bodies {
		}
	}()
	client := budgetsGateway(t, engine, filepath.Join(t.TempDir(), "tokens.json"),
		"tokens_per_day 1000\n\t\t\ttokens_per_minute {http.request.header.X-Budget}30")
	perAnswer := doublePrompt + doubleCompletion // 20
	for i, want := range []int{0, perAnswer} {
		resp, body := askAs(client, "alice")
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Teamserve-Tokens-Last-Minute") != fmt.Sprint(want) ||
			resp.Header.Get("X-Teamserve-Tokens-Per-Minute") != "30" {
			t.Fatalf("answer %d: %d %q, last minute %q of %q, want 200 with %d of 30", i, resp.StatusCode, body,
				resp.Header.Get("X-Teamserve-Tokens-Last-Minute"), resp.Header.Get("X-Teamserve-Tokens-Per-Minute"), want)
		}
	}
	resp, body := askAs(client, "alice") // 40 in the last minute >= 30
	var refusal openAIError
	_ = json.Unmarshal([]byte(body), &refusal)
	if resp.StatusCode != http.StatusTooManyRequests || refusal.Error.Code != TokenPerMinuteCode || refusal.Error.Type != "tokens" ||
		!strings.Contains(refusal.Error.Message, "used 40 tokens in the last minute") || !strings.Contains(refusal.Error.Message, "30 tokens per minute") {
		t.Fatalf("past the budget: %d %q, want 429 %s naming 40 and 30", resp.StatusCode, body, TokenPerMinuteCode)
	}
	if wait, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || wait < 1 || wait > 60 {
		t.Fatalf("Retry-After %q, want the seconds until the first answer is a minute old", resp.Header.Get("Retry-After"))
	}
	if resp, _ := askAs(client, "alice"); resp.Header.Get("X-Teamserve-Tokens-Today") != fmt.Sprint(2*perAnswer) {
		t.Fatalf("tokens today after refusals: %q, want %d (a refusal uses none)", resp.Header.Get("X-Teamserve-Tokens-Today"), 2*perAnswer)
	}
	if resp, body := askAs(client, "bob"); resp.StatusCode != http.StatusOK {
		t.Fatalf("another key: %d %q, want 200", resp.StatusCode, body)
	}
}

// The last minute slides: answers leave it 60 s after they were counted, and the moment a key is under
// its budget again is when enough of its oldest answers have left.
func TestTokenLedgerLastMinute(t *testing.T) {
	clock := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	l := loadLedger(filepath.Join(t.TempDir(), "tokens.json"), zap.NewNop(), func() time.Time { return clock })
	defer l.Destruct()
	for _, step := range []struct {
		after  time.Duration
		tokens int64
	}{{0, 10}, {20 * time.Second, 15}, {10 * time.Second, 5}} { // at :00, :20, :30
		clock = clock.Add(step.after)
		l.add("alice", step.tokens)
	}
	if used, free := l.lastMinute("alice", 20); used != 30 || !free.Equal(time.Date(2026, 12, 5, 12, 1, 20, 0, time.UTC)) {
		t.Fatalf("at :30 with a budget of 20: %d, free at %v; want 30 and 12:01:20 (10 + 15 gone)", used, free)
	}
	if used, free := l.lastMinute("alice", 100); used != 30 || !free.Equal(clock) {
		t.Fatalf("under the budget: %d, free at %v; want 30 and now", used, free)
	}
	clock = time.Date(2026, 12, 5, 12, 1, 0, 0, time.UTC) // the first answer is a minute old
	if used, _ := l.lastMinute("alice", 0); used != 20 {
		t.Fatalf("at 12:01:00: %d, want 20", used)
	}
	clock = clock.Add(31 * time.Second)
	if used, _ := l.lastMinute("alice", 0); used != 0 || len(l.recent) != 0 {
		t.Fatalf("at 12:01:31: %d, %v; want 0 and nothing kept", used, l.recent)
	}
	if used, _ := l.used("alice"); used != 30 {
		t.Fatalf("the day's count: %d, want 30", used)
	}
}

// abortingProxy stands for reverse_proxy whose write to the client failed.
type abortingProxy struct{}

func (abortingProxy) ServeHTTP(http.ResponseWriter, *http.Request) error { panic(http.ErrAbortHandler) }

func TestTokenUsageReturnsWhenTheClientHasGone(t *testing.T) {
	handler := &TokenUsage{}
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	request := httptest.NewRequest(http.MethodGet, "/v1/models", nil).WithContext(gone)
	if err := handler.ServeHTTP(httptest.NewRecorder(), request, abortingProxy{}); err != nil {
		t.Fatalf("a request whose client has gone returned %v, want nil (the server then logs its duration)", err)
	}
	// The client still there (an upstream stream that broke): the abort goes on, so the client sees it.
	defer func() {
		if p := recover(); p != http.ErrAbortHandler {
			t.Fatalf("recovered %v, want http.ErrAbortHandler", p)
		}
	}()
	_ = handler.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/v1/models", nil), abortingProxy{})
	t.Fatal("the abort of a request whose client is still connected was swallowed")
}

// answeringThenAbortingProxy stands for reverse_proxy that wrote `answer` to the client, then aborted: the
// client hung up as soon as it had the answer's Content-Length bytes, before the upstream's end of body
// was read (Caddy logs "aborting with incomplete response", reading: context canceled).
type answeringThenAbortingProxy struct{ answer string }

func (p answeringThenAbortingProxy) ServeHTTP(w http.ResponseWriter, _ *http.Request) error {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write([]byte(p.answer))
	panic(http.ErrAbortHandler)
}

// The whole answer reached the client, so it counts (in the key's tokens and the access log, both from
// the same counts): a client that hangs up fast does not get around a budget. An answer cut before its
// usage counts nothing. Seen at the front gateway, whose client (httpx, curl) closes on the last byte.
func TestTokenUsageCountsAWholeAnswerWhoseClientLeftAtOnce(t *testing.T) {
	whole := `{"id": "chatcmpl-1", "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}}`
	for _, c := range []struct {
		answer string
		want   int64
	}{{whole, 5}, {whole[:40], 0}} {
		ledger := loadLedger(filepath.Join(t.TempDir(), "tokens.json"), zap.NewNop(), time.Now)
		handler := &TokenUsage{MaxSize: 1 << 20, Key: "alice", ledger: ledger}
		gone, cancel := context.WithCancel(context.WithValue(context.Background(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
		cancel()
		request := httptest.NewRequest(http.MethodPost, "/v1/chat/completions",
			strings.NewReader(`{"model":"m","messages":[]}`)).WithContext(gone)
		request.Header.Set("Content-Type", "application/json")
		if err := handler.ServeHTTP(httptest.NewRecorder(), request, answeringThenAbortingProxy{c.answer}); err != nil {
			t.Fatalf("returned %v, want nil (the client has gone)", err)
		}
		if used, _ := ledger.used("alice"); used != c.want {
			t.Fatalf("answer %q: the key's tokens %d, want %d", c.answer, used, c.want)
		}
	}
}

// A cut stream's running counts: the prompt once, and each choice's last completion count summed (n = 2);
// the usage-only chunk, once it comes, is the total. Only the "usage" member is taken out of a chunk.
func TestRunningUsageOfACutStream(t *testing.T) {
	rec := &usageRecorder{strip: usageStrip{final: true, running: true}}
	chunk := func(index, completion int) string {
		return fmt.Sprintf(`data: {"id":"c", "choices":[{"index":%d,"text":"a"}], "usage":{"prompt_tokens":9,"completion_tokens":%d}, "model":"m"}`+"\n\n", index, completion)
	}
	out := rec.events(nil, []byte(chunk(0, 1)+chunk(1, 1)+chunk(0, 2)+chunk(1, 4)))
	if want := `data: {"id":"c","choices":[{"index":1,"text":"a"}],"model":"m"}` + "\n\n"; !strings.HasSuffix(string(out), want) ||
		strings.Contains(string(out), "usage") {
		t.Fatalf("sent on %q, want each chunk without its usage, ending %q", out, want)
	}
	if got, found := rec.counts(); !found || got != (tokenCounts{prompt: 9, completion: 6}) {
		t.Fatalf("cut stream counts %+v %v, want prompt 9 and completion 2+4", got, found)
	}
	if out := rec.events(nil, []byte(`data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":7}}`+"\n\n")); len(out) != 0 {
		t.Fatalf("usage-only chunk sent on: %q", out)
	}
	if got, _ := rec.counts(); got != (tokenCounts{prompt: 9, completion: 7}) {
		t.Fatalf("counts %+v after the usage-only chunk, want its total", got)
	}
	if got := string(withoutMember([]byte(`{"a":1, "\u0075sage" : {"x":[1,2]} ,"b":"usage"}`), "usage")); got != `{"a":1,"b":"usage"}` {
		t.Fatalf("withoutMember: %s", got)
	}
}
