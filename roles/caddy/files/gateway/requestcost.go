// request_cost is a Caddy HTTP handler that sets a placeholder to the request's cost: the number of
// engine sequences it asks for, which is what fills the engine's batch (vLLM --max-num-seqs). One
// /v1/completions request with 8 prompts and n=8 runs 64 sequences; counting it as one request would
// let one user hold the whole batch. inflight_limit's `cost` option caps a user's sum of these.
//
// Caddyfile:
//
//	request_cost {teamserve_cost}
//
//	request_cost {teamserve_cost} {
//		max_size 67108864    # bytes read at most; a larger body gets 413 (default 64 MiB)
//	}
//
// The destination is one placeholder in braces, as request_model's. Its value is a Cost: as text
// ({teamserve_cost} in log_append, a header, a matcher) the number of sequences, e.g. "16";
// inflight_limit also reads the factors from it, to say in its 400 which field to lower.
//
// The cost, by path (r.URL.Path, as vLLM routes it), from vLLM's request models
// (vllm/entrypoints/openai/{chat_completion,completion}/protocol.py, the pooling protocols, and
// OnlineRenderer.preprocess_completion, which runs the prompt_embeds and then the prompt entries):
//
//	/v1/chat/completions  n (absent or null: 1)
//	/v1/completions       (prompts) × n, prompts = entries of prompt + entries of prompt_embeds:
//	                      prompt "text" 1, ["a","b"] 2, [1,2,3] (one tokenized prompt) 1,
//	                      [[1,2],[3]] 2, [], absent or null 0; prompt_embeds "<base64>" 1,
//	                      ["<b64>","<b64>"] 2; no prompt at all counts 1 (the engine answers it)
//	/v1/embeddings        the entries of input, same shapes as prompt (absent: 1, a chat-style request)
//	/v1/responses         1
//	any other path        1, the body not read
//
// A body that is not JSON (Content-Type other than application/json, invalid JSON, not an object)
// costs 1 and is forwarded as it came: the engine answers its own 400 or 415. JSON is read as the
// engine reads it (jsondoc.go): NaN and a byte order mark do not make a body "not JSON" here.
//
// Refused at once, never forwarded, with 400 and an OpenAI-style error whose param names the field
// (the access log's "refused" field gets the code):
//
//   - n not an integer (1.5, "2", true, null in a list...): code invalid_type; n < 1: code
//     integer_below_min_value. n written as an integral float (2.0, 2e0) is 2, as pydantic reads it;
//   - prompt / input / prompt_embeds of a shape the engine refuses: a list mixing strings and token
//     ids, a token-id list holding anything but numbers (deeper lists included), a number, a boolean
//     or an object in place of the prompt: code invalid_type;
//   - a JSON body in UTF-16 or UTF-32, which the engine would decode but the gateway does not read:
//     code unsupported_encoding, param null.
//
// Counting is in place and bounded: the body (at most max_size bytes, held once per request with
// request_model and request_priority, body.go) is checked once for validity, then the few members
// above are found and their lists' entries counted without decoding them: a list of 10,000 prompts
// costs one pass over its bytes and no allocation per entry. Counts saturate at MaxCost.
//
// Order: after request_body (whose max_size bounds the read), before inflight_limit (which reads the
// placeholder). The placeholder is set on every request, 1 first, so nothing earlier stands in for it.

package gateway

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// The codes of request_cost's 400s (OpenAI's own codes for the same faults).
const (
	CodeInvalidType         = "invalid_type"
	CodeBelowMinValue       = "integer_below_min_value"
	CodeUnsupportedEncoding = "unsupported_encoding"
)

// MaxCost is where counts saturate: n, the number of prompts and their product are never taken as
// more than this (far above any engine's batch, so a saturated cost is always refused).
const MaxCost = math.MaxInt32

func init() {
	caddy.RegisterModule(RequestCost{})
	httpcaddyfile.RegisterHandlerDirective("request_cost", parseRequestCostCaddyfile)
	// Outside a `route` block: right after request_body, whose max_size bounds the read, and so long
	// before inflight_limit (just before reverse_proxy) that reads the placeholder. Inside a route,
	// the order is as written.
	httpcaddyfile.RegisterDirectiveOrder("request_cost", httpcaddyfile.After, "request_body")
}

// Cost is the value request_cost sets: the engine sequences one request asks for, and the factors.
type Cost struct {
	// Sequences is N × Prompts, at most MaxCost.
	Sequences int
	// N is the request's n (1 where the API has none, or it is absent).
	N int
	// Prompts is the number of prompts (completions) or inputs (embeddings); 1 where the API takes one.
	Prompts int
	// Field is the member the prompts came from: "prompt", "prompt_embeds", "input", or "" (none).
	Field string
}

// unitCost is the cost of every request with nothing to count.
var unitCost = Cost{Sequences: 1, N: 1, Prompts: 1}

// String is the number of sequences, the placeholder's text.
func (c Cost) String() string { return strconv.Itoa(c.Sequences) }

// Factors says where the sequences come from, e.g. "n=2 × 8 prompts", "8 inputs", "n=16"; "" for 1.
func (c Cost) Factors() string {
	var parts []string
	if c.N > 1 {
		parts = append(parts, "n="+strconv.Itoa(c.N))
	}
	if c.Field != "" && c.Prompts > 1 {
		unit := "prompts"
		if c.Field == "input" {
			unit = "inputs"
		}
		parts = append(parts, strconv.Itoa(c.Prompts)+" "+unit)
	}
	return strings.Join(parts, " × ")
}

// Param is the field to lower when the request costs too much: n or the prompt list, whichever
// contributes more (n on a tie); "" when neither is more than 1 (a cost that came from elsewhere).
func (c Cost) Param() string {
	switch {
	case c.Field != "" && c.Prompts > max(c.N, 1):
		return c.Field
	case c.N > 1:
		return "n"
	}
	return ""
}

// costError is a request refused for a field the engine would refuse: 400, param and code as given.
type costError struct {
	param, code, message string
}

func (e *costError) Error() string { return e.message }

// RequestCost sets a placeholder to the engine sequences the request asks for.
type RequestCost struct {
	// Destination is the placeholder to set, in braces, e.g. "{teamserve_cost}". Required.
	Destination string `json:"destination,omitempty"`
	// MaxSize is the most body bytes read; a larger body is refused with 413. Default DefaultBodyMax.
	MaxSize int64 `json:"max_size,omitempty"`

	name   string
	logger *zap.Logger
}

// CaddyModule returns the Caddy module information.
func (RequestCost) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.request_cost",
		New: func() caddy.Module { return new(RequestCost) },
	}
}

// Provision checks the configuration and fills in the default size bound.
func (c *RequestCost) Provision(ctx caddy.Context) error {
	c.logger = ctx.Logger()
	if err := c.Validate(); err != nil {
		return err
	}
	c.name = c.Destination[1 : len(c.Destination)-1]
	if c.MaxSize == 0 {
		c.MaxSize = DefaultBodyMax
	}
	return nil
}

// Validate reports configuration errors (also run by Provision).
func (c *RequestCost) Validate() error {
	if err := checkPlaceholder(c.Destination); err != nil {
		return fmt.Errorf("request_cost: %v", err)
	}
	if c.MaxSize < 0 {
		return fmt.Errorf("request_cost: max_size %d must be >= 1 byte", c.MaxSize)
	}
	return nil
}

// costedPaths are the vLLM endpoints whose body says how many sequences they run.
var costedPaths = map[string]bool{
	"/v1/chat/completions": true,
	"/v1/completions":      true,
	"/v1/embeddings":       true,
	"/v1/responses":        true,
}

// ServeHTTP sets the destination and calls the next handler with the body intact, or refuses a
// request whose n or prompts the engine would refuse.
func (c *RequestCost) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	// First, so an error route or a refusal below sees 1 rather than an older value.
	repl.Set(c.name, unitCost)
	if !costedPaths[r.URL.Path] || !hasJSONBody(r) {
		return next.ServeHTTP(w, r)
	}
	body, err := bufferedBody(r, c.MaxSize)
	if err != nil {
		return bodyReadError("request_cost", c.MaxSize, err, c.logger)
	}
	cost, cerr := requestCost(r.URL.Path, body)
	if cerr != nil {
		logRefusal(r, cerr.code)
		return writeOpenAIError(w, http.StatusBadRequest, cerr.message, "invalid_request_error", cerr.param, cerr.code, 0)
	}
	repl.Set(c.name, cost)
	return next.ServeHTTP(w, r)
}

// requestCost is the cost of a request to path with body, or why the engine would refuse it.
func requestCost(path string, body []byte) (Cost, *costError) {
	doc, _, kind := engineJSON(body)
	switch kind {
	case docNotUTF8:
		return unitCost, &costError{code: CodeUnsupportedEncoding,
			message: "The request body must be JSON encoded as UTF-8."}
	case docObject:
	default:
		return unitCost, nil // the engine answers its own 400
	}
	var n, prompt, embeds, input []byte
	members(doc, func(m member) {
		value := doc[m.start:m.end]
		switch {
		case isName(m.name, "n"):
			n = value
		case isName(m.name, "prompt"):
			prompt = value
		case isName(m.name, "prompt_embeds"):
			embeds = value
		case isName(m.name, "input"):
			input = value
		}
	})
	cost := unitCost
	switch path {
	case "/v1/chat/completions":
		var err *costError
		if cost.N, err = countN(n); err != nil {
			return unitCost, err
		}
	case "/v1/completions":
		var err *costError
		if cost.N, err = countN(n); err != nil {
			return unitCost, err
		}
		texts, err := countPrompts("prompt", prompt)
		if err != nil {
			return unitCost, err
		}
		embedded, err := countEmbeds(embeds)
		if err != nil {
			return unitCost, err
		}
		cost.Prompts, cost.Field = max(1, min(texts+embedded, MaxCost)), "prompt"
		if texts == 0 && embedded > 0 {
			cost.Field = "prompt_embeds"
		}
	case "/v1/embeddings":
		if input != nil {
			inputs, err := countPrompts("input", input)
			if err != nil {
				return unitCost, err
			}
			cost.Prompts, cost.Field = max(1, inputs), "input"
		}
	}
	cost.Sequences = int(min(int64(cost.N)*int64(cost.Prompts), MaxCost))
	return cost, nil
}

// countN reads n: absent or null is 1 (chat's n is int | None; completions' refuses null itself); an
// integer >= 1, or a float with no fraction (pydantic's reading of 2.0), is itself, at most MaxCost.
func countN(value []byte) (int, *costError) {
	const rule = "n (the number of choices to generate for each prompt) must be an integer >= 1"
	if value == nil || string(value) == "null" {
		return 1, nil
	}
	if !isNumber(value) {
		return 0, &costError{param: "n", code: CodeInvalidType,
			message: fmt.Sprintf("%s; got %s (%s).", rule, jsonType(value), clip(value))}
	}
	invalid := func(code string) (int, *costError) {
		return 0, &costError{param: "n", code: code, message: fmt.Sprintf("%s; got %s.", rule, clip(value))}
	}
	text := string(value)
	if strings.ContainsAny(text, "NI") {
		return invalid(CodeInvalidType) // NaN, Infinity, -Infinity
	}
	if !strings.ContainsAny(text, ".eE") { // an integer literal
		i, err := strconv.ParseInt(text, 10, 64)
		switch {
		case err != nil && text[0] == '-', err == nil && i < 1:
			return invalid(CodeBelowMinValue)
		case err != nil || i > MaxCost: // beyond int64, or just large
			return MaxCost, nil
		}
		return int(i), nil
	}
	f, _ := strconv.ParseFloat(text, 64) // out of range: ±Inf (refused below) or 0 (below the minimum)
	switch {
	case math.IsInf(f, 0) || f != math.Trunc(f):
		return invalid(CodeInvalidType)
	case f < 1:
		return invalid(CodeBelowMinValue)
	}
	return int(min(f, MaxCost)), nil
}

// countPrompts counts the prompts in the value of field (prompt, or input for embeddings), as
// vLLM's type list[int] | list[list[int]] | str | list[str] and prompt_to_seq read it: absent, null
// or an empty list 0, a string 1, a list of numbers (one tokenized prompt) 1, a list of strings or of
// number lists its length. Anything else is refused, as the engine would refuse it.
func countPrompts(field string, value []byte) (int, *costError) {
	rule := field + " must be a string, a list of strings, a list of token ids (integers) or a list of token-id lists"
	if value == nil || string(value) == "null" {
		return 0, nil
	}
	switch value[0] {
	case '"':
		return 1, nil
	case '[':
	default:
		return 0, &costError{param: field, code: CodeInvalidType, message: fmt.Sprintf("%s; got %s.", rule, jsonType(value))}
	}
	count, first := 0, ""
	var bad *costError
	elements(value, func(e []byte) bool {
		kind := jsonType(e)
		switch {
		case kind != "a string" && kind != "a number" && kind != "a list":
			bad = &costError{param: field, code: CodeInvalidType,
				message: fmt.Sprintf("%s; entry %d is %s.", rule, count, kind)}
		case first == "":
			first = kind
		case kind != first:
			bad = &costError{param: field, code: CodeInvalidType,
				message: fmt.Sprintf("%s; this list mixes %s (entry 0) and %s (entry %d).", rule, plural(first), plural(kind), count)}
		}
		if bad == nil && kind == "a list" {
			tokens := 0
			elements(e, func(t []byte) bool {
				if !isNumber(t) {
					bad = &costError{param: field, code: CodeInvalidType,
						message: fmt.Sprintf("%s; entry %d is a token-id list, whose entry %d is %s.", rule, count, tokens, jsonType(t))}
				}
				tokens++
				return bad == nil
			})
		}
		count = min(count+1, MaxCost)
		return bad == nil
	})
	switch {
	case bad != nil:
		return 0, bad
	case first == "a number":
		return 1, nil // one tokenized prompt
	}
	return count, nil // an empty list holds no prompt (prompt_to_seq([]) is [])
}

// countEmbeds counts the entries of prompt_embeds (bytes | list[bytes]: base64 strings): absent or
// null 0, a string 1, a list of strings its length.
func countEmbeds(value []byte) (int, *costError) {
	const rule = "prompt_embeds must be a base64 string or a list of them"
	if value == nil || string(value) == "null" {
		return 0, nil
	}
	switch value[0] {
	case '"':
		return 1, nil
	case '[':
	default:
		return 0, &costError{param: "prompt_embeds", code: CodeInvalidType, message: fmt.Sprintf("%s; got %s.", rule, jsonType(value))}
	}
	count := 0
	var bad *costError
	elements(value, func(e []byte) bool {
		if e[0] != '"' {
			bad = &costError{param: "prompt_embeds", code: CodeInvalidType,
				message: fmt.Sprintf("%s; entry %d is %s.", rule, count, jsonType(e))}
		}
		count = min(count+1, MaxCost)
		return bad == nil
	})
	if bad != nil {
		return 0, bad
	}
	return count, nil
}

// plural turns jsonType's "a string" into "strings" for the messages.
func plural(kind string) string {
	switch kind {
	case "a string":
		return "strings"
	case "a number":
		return "token ids"
	case "a list":
		return "token-id lists"
	}
	return kind
}

// clip quotes at most 40 bytes of a value for an error message.
func clip(value []byte) string {
	if len(value) > 40 {
		return string(value[:40]) + "..."
	}
	return string(value)
}

// UnmarshalCaddyfile reads
//
//	request_cost <destination> [{
//		max_size <bytes>
//	}]
func (c *RequestCost) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	dest, maxSize, err := unmarshalBodyReader(d, "request_cost", "{teamserve_cost}")
	if err != nil {
		return err
	}
	c.Destination, c.MaxSize = dest, maxSize
	return nil
}

func parseRequestCostCaddyfile(helper httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	c := new(RequestCost)
	err := c.UnmarshalCaddyfile(helper.Dispenser)
	return c, err
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*RequestCost)(nil)
	_ caddy.Validator             = (*RequestCost)(nil)
	_ caddyhttp.MiddlewareHandler = (*RequestCost)(nil)
	_ caddyfile.Unmarshaler       = (*RequestCost)(nil)
	_ fmt.Stringer                = Cost{}
)
