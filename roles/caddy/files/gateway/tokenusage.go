// token_usage is a Caddy HTTP handler that reads the engine's own token counts from each answer and
// puts them in the request's access-log entry as "prompt_tokens" and "completion_tokens" (integers),
// where the monitoring role's mtail program counts them per user; with a ledger, it also keeps each
// key's tokens of the day (UTC) and of the last minute, and refuses a key past its daily or per-minute
// budget.
//
// Caddyfile (inside the route, just before reverse_proxy):
//
//	token_usage [{
//		max_size       <bytes>        # the most request body bytes read (default 64 MiB; larger: 413)
//		key            <placeholder>  # whose tokens, e.g. {teamserve_user}; needs ledger
//		ledger         <file>         # where the day's counts per key are kept (tokenbudget.go)
//		tokens_per_day <n|placeholder> # the key's daily budget, prompt + completion tokens; 0 = none
//		tokens_per_minute <n|placeholder> # the same over the last 60 s (sliding); 0 = none
//	}]
//
// Budget: a request of a key whose tokens today are at or past its tokens_per_day is answered at once
// with 429 and an OpenAI-style error (type "tokens", code "token_budget_exceeded") naming the budget
// and the reset time (00:00 UTC), with Retry-After the seconds until then; its access-log entry gets
// "refused": "token_budget_exceeded". The check is made when a request arrives and the tokens are
// counted when its answer ends, so requests already running may take a key past its budget by what
// they use. Per minute: a key whose answers that ended in the last 60 s used tokens_per_minute or more
// gets 429 "tokens_per_minute_exceeded" (type "tokens"), with Retry-After the seconds until enough of
// those answers are older than a minute. Every answer of a key with a ledger carries
// X-Teamserve-Tokens-Today (its tokens today before this request) and, with a budget,
// X-Teamserve-Tokens-Per-Day, X-Teamserve-Tokens-Last-Minute and X-Teamserve-Tokens-Per-Minute; the
// same figures are the placeholders {token_usage.tokens_today}, {token_usage.resets_at} (Unix seconds)
// and {token_usage.tokens_last_minute} for the handlers after it (e.g. a respond that tells users where
// they stand; without tokens_per_day and tokens_per_minute, nothing is refused).
//
// What is read, in vLLM's and OpenAI's shapes:
//
//   - a JSON answer (chat, completions, embeddings, responses): its top-level "usage"
//     {"prompt_tokens", "completion_tokens"} or, for /v1/responses, {"input_tokens", "output_tokens"},
//     found as the answer passes (usagescan.go): an answer of any size counts, and none is held;
//   - a server-sent-events stream: the "usage" of its usage-only chunk (with stream_options
//     include_usage the engine sends it last, with empty "choices"), or, for /v1/responses, the
//     "response"."usage" of its response.completed event;
//   - a stream cut before that chunk (the client hung up, the engine failed): the running counts vLLM
//     puts in every chunk with stream_options continuous_usage_stats, each chunk's "usage" being its
//     choice's tokens so far: the prompt tokens (the largest seen) and the sum over the choices of
//     their last completion_tokens. Exact for one prompt and n = 1; with several prompts in one
//     completions request, a cut stream counts the longest prompt only.
//
// A stream counts only if the engine is asked for its usage, so a JSON object body that asks for a
// stream gets "stream_options" {"include_usage": true, "continuous_usage_stats": true} (other
// stream_options members kept; every other byte of the body as the client sent it), and what the client
// did not ask for is taken out of the stream before it reaches the client: the usage-only chunk, and the
// "usage" member of every other chunk. A client that asked keeps them. "Asks" is read as the engine
// reads a bool (engineBool): "stream": 1, "true", "yes" or 1.0 stream as true does, and are asked for
// usage the same way; so are include_usage and continuous_usage_stats.
//
// Only answers with a 2xx status are read; an answer without usage (an error, a cut stream) adds no
// field. A whole JSON answer counts even when its client hangs up on the last byte, before
// reverse_proxy has read the upstream's end of body and while it aborts. A JSON body in UTF-16/32
// is forwarded unchanged (request_priority refuses it where it runs). Server-sent events go out whole:
// the handler holds at most one incomplete event and writes each complete one as it arrives, so a stream
// is not delayed by more than the engine's own chunking. Cost per event: one validity pass and a walk of
// the chunk's top-level members, with no allocation (encoding/json's decoder took 18 allocations a chunk).
//
// Source of the shapes: OpenAI's API reference (chat completion chunk, stream_options.include_usage;
// responses streaming events) and vLLM's OpenAI-compatible server, which emits the usage-only chunk
// with empty choices when include_usage is set and omits unset fields from other chunks.

package gateway

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// Access-log fields token_usage sets.
const (
	PromptTokensLogField     = "prompt_tokens"
	CompletionTokensLogField = "completion_tokens"
)

func init() {
	caddy.RegisterModule(TokenUsage{})
	httpcaddyfile.RegisterHandlerDirective("token_usage", parseTokenUsageCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("token_usage", httpcaddyfile.Before, "reverse_proxy")
}

// TokenUsage records each answer's prompt and completion tokens in the access log.
type TokenUsage struct {
	// MaxSize is the most request body bytes read; a larger body is refused with 413. Default DefaultBodyMax.
	MaxSize int64 `json:"max_size,omitempty"`
	// Key names whose tokens a request's are (placeholders, expanded per request). Needs Ledger.
	Key string `json:"key,omitempty"`
	// Ledger is the file the day's tokens per key are kept in. Needs Key.
	Ledger string `json:"ledger,omitempty"`
	// TokensPerDay is the key's budget of prompt + completion tokens per UTC day: an integer >= 0 (0 =
	// none), or placeholders that expand to one per request. Needs Key and Ledger.
	TokensPerDay string `json:"tokens_per_day,omitempty"`
	// TokensPerMinute is the key's budget of prompt + completion tokens in the last 60 s (sliding), in
	// the same forms as TokensPerDay. Needs Key and Ledger.
	TokensPerMinute string `json:"tokens_per_minute,omitempty"`

	logger *zap.Logger
	ledger *tokenLedger
}

// Placeholders token_usage sets with a ledger: the key's tokens today before this request, and when the
// day's counts start again (Unix seconds).
const (
	TokensTodayPlaceholder      = "token_usage.tokens_today"
	TokensResetPlaceholder      = "token_usage.resets_at"
	TokensLastMinutePlaceholder = "token_usage.tokens_last_minute"
)

// The error codes (and access-log "refused" values) of a request past its key's daily or per-minute budget.
const (
	TokenBudgetCode    = "token_budget_exceeded"
	TokenPerMinuteCode = "tokens_per_minute_exceeded"
)

// CaddyModule returns the Caddy module information.
func (TokenUsage) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.token_usage",
		New: func() caddy.Module { return new(TokenUsage) },
	}
}

// Provision fills in the defaults.
func (t *TokenUsage) Provision(ctx caddy.Context) error {
	t.logger = ctx.Logger()
	if t.MaxSize == 0 {
		t.MaxSize = DefaultBodyMax
	}
	if err := t.Validate(); err != nil {
		return err
	}
	if t.Ledger != "" {
		value, _, err := ledgers.LoadOrNew(t.Ledger, func() (caddy.Destructor, error) {
			return loadLedger(t.Ledger, t.logger, time.Now), nil
		})
		if err != nil {
			return err
		}
		t.ledger = value.(*tokenLedger)
	}
	return nil
}

// Cleanup drops this config's reference to the ledger (the last one writes it).
func (t *TokenUsage) Cleanup() error {
	if t.ledger != nil {
		_, err := ledgers.Delete(t.Ledger)
		return err
	}
	return nil
}

// Validate reports configuration errors (also run by Provision).
func (t *TokenUsage) Validate() error {
	if t.MaxSize < 0 {
		return fmt.Errorf("token_usage: max_size %d must be >= 1 byte", t.MaxSize)
	}
	if (t.Key == "") != (t.Ledger == "") {
		return fmt.Errorf("token_usage: key and ledger go together (key %q, ledger %q)", t.Key, t.Ledger)
	}
	for option, value := range map[string]string{"tokens_per_day": t.TokensPerDay, "tokens_per_minute": t.TokensPerMinute} {
		if value != "" && t.Key == "" {
			return fmt.Errorf("token_usage: %s needs key and ledger", option)
		}
		if value != "" && !strings.Contains(value, "{") {
			if _, err := parseTokens(value); err != nil {
				return fmt.Errorf("token_usage: %s %q: %v", option, value, err)
			}
		}
	}
	return nil
}

// budget expands a budget option for this request: 0 when unset; an error when it is not a count.
func (t *TokenUsage) budget(repl *caddy.Replacer, option, value string) (int64, error) {
	if value == "" {
		return 0, nil
	}
	text := repl.ReplaceAll(value, "")
	n, err := parseTokens(text)
	if err != nil { // a config error: fail closed, say why in the log
		t.logger.Error("token_usage: unusable budget", zap.String(option, text), zap.Error(err))
		return 0, caddyhttp.Error(http.StatusInternalServerError, fmt.Errorf("token_usage: %s %q: %v", option, text, err))
	}
	return n, nil
}

// parseTokens reads a token count >= 0.
func parseTokens(s string) (int64, error) {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("not an integer")
	}
	if n < 0 {
		return 0, fmt.Errorf("must be >= 0")
	}
	return n, nil
}

// tokenCounts is an answer's usage, in tokens.
type tokenCounts struct {
	prompt, completion int
}

// ServeHTTP refuses a key past its budget, asks a stream for its usage, then reads the usage from the
// answer on its way out.
func (t *TokenUsage) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	key := ""
	if t.ledger != nil {
		repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		key = repl.ReplaceAll(t.Key, "")
		used, reset := t.ledger.used(key)
		w.Header().Set("X-Teamserve-Tokens-Today", strconv.FormatInt(used, 10))
		repl.Set(TokensTodayPlaceholder, used)
		repl.Set(TokensResetPlaceholder, reset.Unix())
		perDay, err := t.budget(repl, "tokens_per_day", t.TokensPerDay)
		if err != nil {
			return err
		}
		perMinute, err := t.budget(repl, "tokens_per_minute", t.TokensPerMinute)
		if err != nil {
			return err
		}
		lastMinute, free := t.ledger.lastMinute(key, perMinute)
		repl.Set(TokensLastMinutePlaceholder, lastMinute)
		if perDay > 0 {
			w.Header().Set("X-Teamserve-Tokens-Per-Day", strconv.FormatInt(perDay, 10))
		}
		if perMinute > 0 {
			w.Header().Set("X-Teamserve-Tokens-Last-Minute", strconv.FormatInt(lastMinute, 10))
			w.Header().Set("X-Teamserve-Tokens-Per-Minute", strconv.FormatInt(perMinute, 10))
		}
		switch now := t.ledger.now(); {
		case perDay > 0 && used >= perDay: // the longer wait first
			logRefusal(r, TokenBudgetCode)
			return refuseTokenBudget(w, used, perDay, reset, now)
		case perMinute > 0 && lastMinute >= perMinute:
			logRefusal(r, TokenPerMinuteCode)
			return refuseTokensPerMinute(w, lastMinute, perMinute, free, now)
		}
	}
	var strip usageStrip
	if hasJSONBody(r) {
		body, err := bufferedBody(r, t.MaxSize)
		if err != nil {
			return bodyReadError("token_usage", t.MaxSize, err, t.logger)
		}
		if doc, prefix, kind := engineJSON(body); kind == docObject {
			if rewritten, added := withStreamUsage(doc); added != (usageStrip{}) {
				replaceDoc(r, body, prefix, rewritten)
				strip = added
			}
		}
	}
	rec := newUsageRecorder(w, strip)
	// Deferred: a client that hangs up right after the last event makes reverse_proxy abort (it panics with
	// http.ErrAbortHandler when a write to the client fails), and the access log is still written. When the
	// client has gone there is nobody left to signal, so the handler returns: Caddy's server sets the logged
	// duration only when the handler returns (caddy v2.11.9 modules/caddyhttp/server.go). Any other panic,
	// or an abort while the client is there (a broken upstream stream), goes on.
	defer func() {
		rec.log(r)
		if usage, found := rec.counts(); t.ledger != nil && found {
			t.ledger.add(key, int64(usage.prompt)+int64(usage.completion))
		}
		if p := recover(); p != nil && (p != http.ErrAbortHandler || r.Context().Err() == nil) {
			panic(p)
		}
	}()
	err := next.ServeHTTP(rec, r)
	if ferr := rec.finish(); err == nil {
		err = ferr
	}
	return err
}

// refuseTokenBudget writes the 429 for a key at or past its daily budget.
func refuseTokenBudget(w http.ResponseWriter, used, budget int64, reset, now time.Time) error {
	wait := int(math.Ceil(reset.Sub(now).Seconds()))
	message := fmt.Sprintf("This API key has used %d of its %d tokens for today (prompt and completion tokens, "+
		"UTC day); the budget resets at %s. Retry after the number of seconds in the Retry-After header, or ask "+
		"the admin for a larger tokens_per_day.", used, budget, reset.UTC().Format(time.RFC3339))
	return writeOpenAIError(w, http.StatusTooManyRequests, message, "tokens", "", TokenBudgetCode, max(1, wait))
}

// refuseTokensPerMinute writes the 429 for a key at or past its per-minute budget; free is when its
// last minute's tokens drop below the budget.
func refuseTokensPerMinute(w http.ResponseWriter, used, budget int64, free, now time.Time) error {
	wait := max(1, int(math.Ceil(free.Sub(now).Seconds())))
	message := fmt.Sprintf("This API key's answers used %d tokens in the last minute, at or past its %d tokens per "+
		"minute (prompt and completion tokens); retry in %d s (the Retry-After header), or ask the admin for a "+
		"larger tokens_per_minute.", used, budget, wait)
	return writeOpenAIError(w, http.StatusTooManyRequests, message, "tokens", "", TokenPerMinuteCode, wait)
}

// lastMember returns the value of the last top-level member called name of the object doc (the one
// the engine's JSON parser keeps), or nil.
func lastMember(doc []byte, name string) []byte {
	var value []byte
	members(doc, func(m member) {
		if isName(m.name, name) {
			value = doc[m.start:m.end]
		}
	})
	return value
}

// usageStrip says which of a stream's usage the gateway asked for and the client did not, so that it
// is taken out of the answer again.
type usageStrip struct {
	final   bool // the usage-only last chunk (stream_options include_usage)
	running bool // the "usage" of every other chunk (stream_options continuous_usage_stats)
}

// withStreamUsage returns doc with "stream_options" asking for both usage forms
// ({"include_usage": true, "continuous_usage_stats": true}) when doc asks for a stream ("stream" true as
// the engine reads a bool: engineBool), and which of them the client had not asked for; doc unchanged
// and usageStrip{} when there is nothing to add. vLLM sends the running counts only when include_usage
// is true too, so a client that asked for continuous_usage_stats alone asked for neither. A
// stream_options that is neither an object nor null is left for the engine to refuse.
func withStreamUsage(doc []byte) ([]byte, usageStrip) {
	if stream, _ := engineBool(lastMember(doc, "stream")); !stream {
		return doc, usageStrip{}
	}
	options := lastMember(doc, "stream_options")
	switch {
	case options == nil || string(options) == "null":
		options = []byte(`{}`)
	case options[0] != '{':
		return doc, usageStrip{}
	}
	final, _ := engineBool(lastMember(options, "include_usage"))
	running, _ := engineBool(lastMember(options, "continuous_usage_stats"))
	if final && running {
		return doc, usageStrip{}
	}
	if !final {
		options = withMember(options, "include_usage", []byte("true"))
	}
	options = withMember(options, "continuous_usage_stats", []byte("true"))
	return withMember(doc, "stream_options", options), usageStrip{final: !final, running: true}
}

// usageRecorder passes an answer through to the client and reads its usage on the way.
type usageRecorder struct {
	http.ResponseWriter
	strip usageStrip // what the client did not ask for, taken out of a stream

	wroteHeader bool
	mode        answerMode
	scan        usageScanner // a JSON answer's top-level "usage", read as it passes
	pending     []byte       // a stream's incomplete event
	out         []byte       // the events of one Write as they go on to the client (reused)
	joined      []byte       // an event's data lines joined (reused; vLLM writes one line)
	usage       tokenCounts  // a stream's own total (its usage-only chunk, or response.completed)
	found       bool
	// a stream's running counts (continuous_usage_stats), for when it is cut before its total
	runningPrompt int
	running       map[int]int // choice index -> its completion tokens so far
}

func newUsageRecorder(w http.ResponseWriter, strip usageStrip) *usageRecorder {
	return &usageRecorder{ResponseWriter: w, strip: strip}
}

type answerMode int

const (
	answerOther answerMode = iota // not read: an error, or a type without usage
	answerJSON
	answerEvents
)

func (u *usageRecorder) WriteHeader(status int) {
	if !u.wroteHeader && status >= 200 { // 1xx informational answers come before the real one
		u.wroteHeader = true
		if status < 300 {
			mediaType, _, _ := strings.Cut(u.Header().Get("Content-Type"), ";")
			switch strings.ToLower(strings.TrimSpace(mediaType)) {
			case "application/json":
				u.mode = answerJSON
			case "text/event-stream":
				u.mode = answerEvents
			}
		}
	}
	u.ResponseWriter.WriteHeader(status)
}

func (u *usageRecorder) Write(p []byte) (int, error) {
	if !u.wroteHeader {
		u.WriteHeader(http.StatusOK)
	}
	switch u.mode {
	case answerJSON:
		u.scan.Write(p)
	case answerEvents:
		whole := p // events that end in p, read where they are when nothing is pending
		if len(u.pending) > 0 {
			u.pending = append(u.pending, p...)
			whole = u.pending
		}
		end := lastEventEnd(whole)
		if end == 0 {
			if len(u.pending) == 0 {
				u.pending = append(u.pending, p...)
			}
			return len(p), nil
		}
		u.out = u.events(u.out[:0], whole[:end])
		u.pending = append(u.pending[:0], whole[end:]...)
		if len(u.out) > 0 {
			if _, err := u.ResponseWriter.Write(u.out); err != nil {
				return 0, err
			}
		}
		return len(p), nil
	}
	return u.ResponseWriter.Write(p)
}

// Flush sends what has been written to the client (an incomplete event stays until it is whole).
// Found by http.ResponseController before Unwrap, so reverse_proxy's flushes come through here.
func (u *usageRecorder) Flush() {
	_ = http.NewResponseController(u.ResponseWriter).Flush()
}

// Unwrap gives http.ResponseController the writer underneath for everything else.
func (u *usageRecorder) Unwrap() http.ResponseWriter { return u.ResponseWriter }

// lastEventEnd returns the index just past the last blank line ("\n\n" or "\n\r\n") in b, 0 if none.
// It looks back from the end one line feed at a time: a write from the engine usually ends an event.
func lastEventEnd(b []byte) int {
	for k := len(b); k > 0; {
		i := bytes.LastIndexByte(b[:k], '\n')
		switch {
		case i < 1:
			return 0
		case b[i-1] == '\n', i >= 2 && b[i-1] == '\r' && b[i-2] == '\n':
			return i + 1
		}
		k = i
	}
	return 0
}

// events reads the usage from each complete event in b and appends to out the bytes to send on: b
// without the usage the client did not ask for.
func (u *usageRecorder) events(out, b []byte) []byte {
	for rest := b; len(rest) > 0; {
		end := firstEventEnd(rest)
		out = u.event(out, rest[:end])
		rest = rest[end:]
	}
	return out
}

// firstEventEnd returns the index just past the first blank line in b, len(b) if none.
func firstEventEnd(b []byte) int {
	i := bytes.Index(b, []byte("\n\n"))
	j := bytes.Index(b, []byte("\n\r\n"))
	switch {
	case i < 0 && j < 0:
		return len(b)
	case j < 0 || i >= 0 && i < j:
		return i + 2
	default:
		return j + 3
	}
}

// eventData returns the data of one event: its "data:" lines' values (one leading space dropped)
// joined by "\n" as the server-sent-events format joins them, in place when there is one line (as vLLM
// writes each chunk), in buf otherwise; lines is the number of data lines, at the start of the only
// one.
func eventData(event, buf []byte) (data, newBuf []byte, lines, at int) {
	for rest, offset := event, 0; len(rest) > 0; {
		line := rest
		next := len(rest)
		if i := bytes.IndexByte(rest, '\n'); i >= 0 {
			line, next = rest[:i], i+1
		}
		line = bytes.TrimSuffix(line, []byte("\r"))
		if payload, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			start := offset + len("data:")
			if len(payload) > 0 && payload[0] == ' ' {
				payload, start = payload[1:], start+1
			}
			switch lines {
			case 0:
				data, at = payload, start
			case 1:
				buf = append(append(append(buf[:0], data...), '\n'), payload...)
				data = buf
			default:
				buf = append(append(buf, '\n'), payload...)
				data = buf
			}
			lines++
		}
		rest, offset = rest[next:], offset+next
	}
	return data, buf, lines, at
}

// event reads one event's usage and appends to out what goes on to the client: the event, the event
// without its chunk's "usage" (running counts the client did not ask for), or nothing (a usage-only
// chunk it did not ask for).
func (u *usageRecorder) event(out, event []byte) []byte {
	data, joined, lines, at := eventData(event, u.joined)
	u.joined = joined
	if len(data) == 0 || data[0] != '{' || !json.Valid(data) {
		return append(out, event...) // [DONE], comments, keep-alives
	}
	// One walk of the chunk's members (the last of repeated names counts, as for lastMember).
	var usage, typ, response, choices []byte
	members(data, func(m member) {
		value := data[m.start:m.end]
		switch {
		case isName(m.name, "usage"):
			usage = value
		case isName(m.name, "type"):
			typ = value
		case isName(m.name, "response"):
			response = value
		case isName(m.name, "choices"):
			choices = value
		}
	})
	if typ != nil && isName(typ, "response.completed") && len(response) > 0 && response[0] == '{' {
		usage = lastMember(response, "usage")
	}
	counts, ok := readUsage(usage)
	if !ok {
		return append(out, event...)
	}
	first := -1 // the index of the chunk's first choice; -1: none (a usage-only chunk)
	if len(choices) > 0 && choices[0] == '[' {
		elements(choices, func(choice []byte) bool {
			first = 0
			if index, ok := tokenCount(lastMemberOf(choice, "index")); ok {
				first = index
			}
			return false
		})
	}
	switch {
	case first >= 0: // a running count: this choice's tokens so far
		if u.running == nil {
			u.running = map[int]int{}
		}
		u.running[first] = counts.completion
		u.runningPrompt = max(u.runningPrompt, counts.prompt)
		if u.strip.running && lines == 1 { // vLLM writes each chunk on one data line
			out = append(out, event[:at]...)
			out = appendWithoutMember(out, data, "usage")
			return append(out, event[at+len(data):]...)
		}
		return append(out, event...)
	default:
		u.usage, u.found = counts, true
		if u.strip.final && len(choices) > 0 && choices[0] == '[' {
			return out
		}
		return append(out, event...)
	}
}

// lastMemberOf is lastMember for a value that may not be an object (nil then).
func lastMemberOf(value []byte, name string) []byte {
	if len(value) == 0 || value[0] != '{' {
		return nil
	}
	return lastMember(value, name)
}

// counts returns the answer's tokens: its own total, or, for a stream cut before it, the sum of its
// running counts; false when neither was seen.
func (u *usageRecorder) counts() (tokenCounts, bool) {
	if u.mode == answerJSON {
		return u.scan.usage, u.scan.found
	}
	if u.found || u.running == nil {
		return u.usage, u.found
	}
	total := tokenCounts{prompt: u.runningPrompt}
	for _, completion := range u.running {
		total.completion += completion
	}
	return total, true
}

// finish sends an incomplete last event as it is.
func (u *usageRecorder) finish() error {
	if len(u.pending) > 0 {
		pending := u.pending
		u.pending = nil
		if _, err := u.ResponseWriter.Write(pending); err != nil {
			return err
		}
	}
	return nil
}

// log puts the usage in the request's access-log entry.
func (u *usageRecorder) log(r *http.Request) {
	usage, found := u.counts()
	if !found {
		return
	}
	if extra, ok := r.Context().Value(caddyhttp.ExtraLogFieldsCtxKey).(*caddyhttp.ExtraLogFields); ok && extra != nil {
		extra.Set(zap.Int(PromptTokensLogField, usage.prompt))
		extra.Set(zap.Int(CompletionTokensLogField, usage.completion))
	}
}

// UnmarshalCaddyfile reads
//
//	token_usage [{
//		max_size <bytes>
//		key <placeholder>
//		ledger <file>
//		tokens_per_day <n|placeholder>
//		tokens_per_minute <n|placeholder>
//	}]
func (t *TokenUsage) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		option := d.Val()
		if !d.NextArg() {
			return d.ArgErr()
		}
		value := d.Val()
		switch option {
		case "max_size":
			n, err := strconv.ParseInt(value, 10, 64)
			if err != nil || n < 1 {
				return d.Errf("%s %q must be a whole number of bytes >= 1", option, value)
			}
			t.MaxSize = n
		case "key":
			t.Key = value
		case "ledger":
			t.Ledger = value
		case "tokens_per_day":
			t.TokensPerDay = value
		case "tokens_per_minute":
			t.TokensPerMinute = value
		default:
			return d.Errf("unknown token_usage option %q (max_size, key, ledger, tokens_per_day, tokens_per_minute)", option)
		}
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	return nil
}

func parseTokenUsageCaddyfile(helper httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	t := new(TokenUsage)
	err := t.UnmarshalCaddyfile(helper.Dispenser)
	return t, err
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*TokenUsage)(nil)
	_ caddy.Validator             = (*TokenUsage)(nil)
	_ caddy.CleanerUpper          = (*TokenUsage)(nil)
	_ caddyhttp.MiddlewareHandler = (*TokenUsage)(nil)
	_ caddyfile.Unmarshaler       = (*TokenUsage)(nil)
	_ http.Flusher                = (*usageRecorder)(nil)
)
