// inflight_limit is a Caddy HTTP handler that caps what one key (for teamserve: one user) has in
// flight, so that one client cannot hold every slot of the engine's batch. What counts is each
// request's cost: 1 per request by default, or, with `cost`, the engine sequences it asks for (set by
// request_cost), so that a request with n=8 holds 8 of the user's slots, as it holds 8 of the batch.
//
// Caddyfile:
//
//	inflight_limit {
//		key         {teamserve_user}            # placeholder(s) naming the bucket
//		limit       {teamserve_inflight_limit}  # an integer >= 1, or placeholder(s) that give one
//		cost        {teamserve_cost}            # optional: each request's cost (default 1)
//		retry_after 1                           # seconds, sent in Retry-After on 429
//	}
//
// The key's in-flight sum of costs never exceeds `limit`:
//
//   - a request whose own cost is more than `limit` is answered at once with 400 and an OpenAI-style
//     JSON error (type invalid_request_error, code "too_many_sequences", param the field to lower:
//     "n" or the prompt list), since waiting cannot help; its access-log entry gets "refused":
//     "too_many_sequences";
//   - a request that would take the sum past `limit` is answered at once with 429, a Retry-After
//     header and an OpenAI-style JSON error (code "concurrency_limit_exceeded"); it is not queued, and
//     its access-log entry gets "refused": "concurrency_limit_exceeded".
//
// A request with nothing of its key in flight is always admitted if its cost fits the limit.
//
// An admitted request holds its cost until the rest of the handler chain returns: for reverse_proxy
// that is when the response (a whole SSE stream included) has been copied or the client has gone
// away, and on upstream errors and panics too. The sums are shared across graceful reloads (a usage
// pool keyed by the key expression), so requests that started under the old config count under the
// new one and give their cost back to the same sum. Cost per request: one map access under a mutex;
// empty buckets are deleted, so memory follows the keys in flight, not the keys ever seen.
//
// For the handlers after it (request_priority), an admitted request gets the placeholders
//
//	{inflight_limit.in_flight}  the key's in-flight cost including this request, at admission
//	{inflight_limit.limit}      the limit applied
//	{inflight_limit.cost}       this request's cost
//
// (with two inflight_limit handlers in one chain, the later one's values).
//
// A limit or cost placeholder that gives no usable number (an integer >= 1) is a configuration error:
// 500, logged, and the request is not forwarded.

package gateway

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// ErrorCode is the OpenAI-style error code of the 429 this handler writes. It differs from the rate
// limiter's "rate_limit_exceeded" so clients can tell "too many at once" from "too many per window".
const ErrorCode = "concurrency_limit_exceeded"

// TooManySequencesCode is the OpenAI-style error code of the 400 for a request whose own cost is more
// than its key's limit: it could never be admitted, so it is not a 429 to retry.
const TooManySequencesCode = "too_many_sequences"

// The placeholders an admitted request gets (see the file comment).
const (
	InFlightPlaceholder = "inflight_limit.in_flight"
	LimitPlaceholder    = "inflight_limit.limit"
	CostPlaceholder     = "inflight_limit.cost"
)

func init() {
	caddy.RegisterModule(Handler{})
	httpcaddyfile.RegisterHandlerDirective("inflight_limit", parseCaddyfile)
	// Outside a `route` block: after authentication-like directives, before the proxy.
	httpcaddyfile.RegisterDirectiveOrder("inflight_limit", httpcaddyfile.Before, "reverse_proxy")
}

// Handler limits concurrent requests per key.
type Handler struct {
	// Key names the bucket; placeholders are expanded per request. Required.
	Key string `json:"key,omitempty"`
	// Limit is the most one key may have in flight (the sum of its requests' costs): an integer >= 1,
	// or placeholders that expand to one per request (so each user can have their own limit).
	// Required.
	Limit string `json:"limit,omitempty"`
	// Cost is each request's cost (engine sequences): an integer >= 1, or placeholders that expand to
	// one per request, such as request_cost's destination. Default 1 per request.
	Cost string `json:"cost,omitempty"`
	// RetryAfter is the Retry-After value in seconds on a refusal. Default 1.
	RetryAfter int `json:"retry_after,omitempty"`

	counters *counters
	poolKey  string
	logger   *zap.Logger
}

// counters is the shared state: the sum of the costs in flight per key.
type counters struct {
	mu    sync.Mutex
	byKey map[string]int
}

// Destruct satisfies caddy.Destructor for the usage pool.
func (c *counters) Destruct() error { return nil }

// pool shares counters between the old and the new config across a graceful reload, so requests that
// started under the old config still count against the new one.
var pool = caddy.NewUsagePool()

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.inflight_limit",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision checks the configuration and attaches the shared counters.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	if err := h.Validate(); err != nil {
		return err
	}
	if h.RetryAfter == 0 {
		h.RetryAfter = 1
	}
	// Same key expression = same buckets, across reloads and across handlers in one config.
	h.poolKey = "inflight_limit:" + h.Key
	value, _, err := pool.LoadOrNew(h.poolKey, func() (caddy.Destructor, error) {
		return &counters{byKey: make(map[string]int)}, nil
	})
	if err != nil {
		return err
	}
	h.counters = value.(*counters)
	return nil
}

// Validate reports configuration errors (also run by Provision).
func (h *Handler) Validate() error {
	if strings.TrimSpace(h.Key) == "" {
		return fmt.Errorf("inflight_limit: key is required (e.g. {http.auth.user.id})")
	}
	if strings.TrimSpace(h.Limit) == "" {
		return fmt.Errorf("inflight_limit: limit is required (an integer >= 1 or a placeholder)")
	}
	if !strings.Contains(h.Limit, "{") {
		if _, err := parseLimit(h.Limit); err != nil {
			return fmt.Errorf("inflight_limit: limit %q: %v", h.Limit, err)
		}
	}
	if h.Cost != "" && !strings.Contains(h.Cost, "{") {
		if _, err := parseLimit(h.Cost); err != nil {
			return fmt.Errorf("inflight_limit: cost %q: %v", h.Cost, err)
		}
	}
	if h.RetryAfter < 0 {
		return fmt.Errorf("inflight_limit: retry_after %d must be >= 1 second", h.RetryAfter)
	}
	return nil
}

// Cleanup drops this config's reference to the shared counters.
func (h *Handler) Cleanup() error {
	if h.poolKey != "" {
		_, err := pool.Delete(h.poolKey)
		return err
	}
	return nil
}

func parseLimit(s string) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		return 0, fmt.Errorf("not an integer")
	}
	if n < 1 {
		return 0, fmt.Errorf("must be >= 1")
	}
	return n, nil
}

// acquire adds cost to key's sum unless that would take it past limit; it returns the sum with this
// request (or the sum without it, when refused) and whether it did.
func (c *counters) acquire(key string, cost, limit int) (int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	current := c.byKey[key]
	if cost > limit-current {
		return current, false
	}
	c.byKey[key] = current + cost
	return current + cost, true
}

// release takes cost off key's sum; the entry is removed at zero.
func (c *counters) release(key string, cost int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := c.byKey[key] - cost; n <= 0 {
		delete(c.byKey, key)
	} else {
		c.byKey[key] = n
	}
}

// inFlight returns the cost in flight for key and the number of keys with any (for tests).
func (c *counters) inFlight(key string) (int, int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.byKey[key], len(c.byKey)
}

// ServeHTTP counts the request's cost against its key for as long as the rest of the chain runs.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	key := repl.ReplaceAll(h.Key, "")
	limitText := repl.ReplaceAll(h.Limit, "")
	limit, err := parseLimit(limitText)
	if err != nil {
		// A config error (the placeholder gave no usable number): fail closed, say why in the log.
		h.logger.Error("inflight_limit: unusable limit", zap.String("limit", limitText), zap.Error(err))
		return caddyhttp.Error(http.StatusInternalServerError, fmt.Errorf("inflight_limit: limit %q: %v", limitText, err))
	}
	cost, err := h.requestCost(repl)
	if err != nil {
		h.logger.Error("inflight_limit: unusable cost", zap.Error(err))
		return caddyhttp.Error(http.StatusInternalServerError, err)
	}
	if cost.Sequences > limit {
		logRefusal(r, TooManySequencesCode)
		return refuseTooManySequences(w, cost, limit)
	}
	inFlight, ok := h.counters.acquire(key, cost.Sequences, limit)
	if !ok {
		logRefusal(r, ErrorCode)
		return h.refuse(w, limit, cost.Sequences, inFlight)
	}
	defer h.counters.release(key, cost.Sequences)
	repl.Set(InFlightPlaceholder, inFlight)
	repl.Set(LimitPlaceholder, limit)
	repl.Set(CostPlaceholder, cost.Sequences)
	return next.ServeHTTP(w, r)
}

// requestCost is this request's cost: 1 without a cost option; request_cost's Cost when the option is
// that one placeholder (so the 400 can name the field); else the number the placeholders expand to.
func (h *Handler) requestCost(repl *caddy.Replacer) (Cost, error) {
	if h.Cost == "" {
		return unitCost, nil
	}
	if strings.Count(h.Cost, "{") == 1 && strings.HasPrefix(h.Cost, "{") && strings.HasSuffix(h.Cost, "}") {
		if value, ok := repl.Get(h.Cost[1 : len(h.Cost)-1]); ok {
			if cost, ok := value.(Cost); ok && cost.Sequences >= 1 {
				return cost, nil
			}
		}
	}
	text := repl.ReplaceAll(h.Cost, "")
	n, err := parseLimit(text)
	if err != nil {
		return Cost{}, fmt.Errorf("inflight_limit: cost %q (from %s): %v", text, h.Cost, err)
	}
	return Cost{Sequences: n, N: 1, Prompts: 1}, nil
}

// RefusedLogField names the access-log field that carries the error code of a refusal; the gateway's
// Caddyfile sets the same field (log_append) for the refusals it answers itself, so log readers can
// count refusals by kind and tell this 429 from the rate limiter's.
const RefusedLogField = "refused"

// logRefusal adds `refused` = code to the request's access-log entry. The extra fields exist only
// inside Caddy's HTTP server: elsewhere (a bare handler in a test) there is nothing to add to.
func logRefusal(r *http.Request, code string) {
	if extra, ok := r.Context().Value(caddyhttp.ExtraLogFieldsCtxKey).(*caddyhttp.ExtraLogFields); ok && extra != nil {
		extra.Set(zap.String(RefusedLogField, code))
	}
}

type openAIError struct {
	Error openAIErrorBody `json:"error"`
}

type openAIErrorBody struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    string  `json:"code"`
}

// writeOpenAIError writes an error in the shape of OpenAI's API errors, as the gateway's other errors
// are: {"error": {"message", "type", "param" (null when ""), "code"}}, with Retry-After (seconds)
// when retryAfter > 0.
func writeOpenAIError(w http.ResponseWriter, status int, message, typ, param, code string, retryAfter int) error {
	e := openAIErrorBody{Message: message, Type: typ, Code: code}
	if param != "" {
		e.Param = &param
	}
	var body bytes.Buffer
	encoder := json.NewEncoder(&body)
	encoder.SetEscapeHTML(false) // ">=" as written, not "\u003e="
	if err := encoder.Encode(openAIError{Error: e}); err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/json")
	if retryAfter > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(retryAfter))
	}
	w.WriteHeader(status)
	_, err := w.Write(bytes.TrimSuffix(body.Bytes(), []byte("\n")))
	return err
}

// refuse writes the 429. cost is the request's, inFlight the key's sum without it.
func (h *Handler) refuse(w http.ResponseWriter, limit, cost, inFlight int) error {
	message := fmt.Sprintf("Too many requests in flight for this API key (limit %d). Wait for one to finish; "+
		"retry after the number of seconds in the Retry-After header.", limit)
	if h.Cost != "" {
		message = fmt.Sprintf("Too many sequences in flight for this API key (limit %d): %d in flight, and this "+
			"request needs %d. Wait for one to finish; retry after the number of seconds in the Retry-After header.",
			limit, inFlight, cost)
	}
	return writeOpenAIError(w, http.StatusTooManyRequests, message, "requests", "", ErrorCode, h.RetryAfter)
}

// refuseTooManySequences writes the 400 for a request that costs more than the key's whole limit.
func refuseTooManySequences(w http.ResponseWriter, cost Cost, limit int) error {
	asks := fmt.Sprintf("%d sequences", cost.Sequences)
	if factors := cost.Factors(); factors != "" {
		asks += " (" + factors + ")"
	}
	message := fmt.Sprintf("This request asks for %s; your share of the engine is %d sequences at once. "+
		"Send at most %d per request: lower n, or split the prompts over several requests.", asks, limit, limit)
	return writeOpenAIError(w, http.StatusBadRequest, message, "invalid_request_error", cost.Param(), TooManySequencesCode, 0)
}

// UnmarshalCaddyfile reads
//
//	inflight_limit [<key> <limit>] {
//		key <placeholder>
//		limit <n|placeholder>
//		cost <n|placeholder>
//		retry_after <seconds>
//	}
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive name
	args := d.RemainingArgs()
	switch len(args) {
	case 0:
	case 2:
		h.Key, h.Limit = args[0], args[1]
	default:
		return d.Errf("inflight_limit takes either no arguments or <key> <limit>, got %d", len(args))
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "key":
			if !d.NextArg() {
				return d.ArgErr()
			}
			h.Key = d.Val()
		case "limit":
			if !d.NextArg() {
				return d.ArgErr()
			}
			h.Limit = d.Val()
		case "cost":
			if !d.NextArg() {
				return d.ArgErr()
			}
			h.Cost = d.Val()
		case "retry_after":
			if !d.NextArg() {
				return d.ArgErr()
			}
			n, err := strconv.Atoi(d.Val())
			if err != nil || n < 1 {
				return d.Errf("retry_after %q must be a whole number of seconds >= 1", d.Val())
			}
			h.RetryAfter = n
		default:
			return d.Errf("unknown inflight_limit option %q (key, limit, cost, retry_after)", d.Val())
		}
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	if h.Key == "" || h.Limit == "" {
		return d.Err("inflight_limit needs a key and a limit")
	}
	return nil
}

func parseCaddyfile(helper httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	h := new(Handler)
	err := h.UnmarshalCaddyfile(helper.Dispenser)
	return h, err
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
	_ caddyfile.Unmarshaler       = (*Handler)(nil)
)
