// inflight_limit is a Caddy HTTP handler that caps the number of requests in flight per key
// (for teamserve: per user), so that one client cannot hold every slot of the engine's batch.
//
// Caddyfile:
//
//	inflight_limit {
//		key         {teamserve_user}            # placeholder(s) naming the bucket
//		limit       {teamserve_inflight_limit}  # an integer >= 1, or placeholder(s) that give one
//		retry_after 1                           # seconds, sent in Retry-After on 429
//	}
//
// A request whose key already has `limit` requests in flight is answered at once with 429, a
// Retry-After header and an OpenAI-style JSON error (code "concurrency_limit_exceeded"); it is not
// queued, and its access-log entry gets the field "refused": "concurrency_limit_exceeded". A slot is
// held until the rest of the handler chain returns: for reverse_proxy that is when the response (a
// whole SSE stream included) has been copied or the client has gone away. The slot is released on
// panics too. Cost per request: one map lookup under a mutex; empty buckets are deleted,
// so memory follows the keys in flight, not the keys ever seen.

package gateway

import (
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
	// Limit is the most requests one key may have in flight: an integer >= 1, or placeholders that
	// expand to one per request (so each user can have their own limit). Required.
	Limit string `json:"limit,omitempty"`
	// RetryAfter is the Retry-After value in seconds on a refusal. Default 1.
	RetryAfter int `json:"retry_after,omitempty"`

	counters *counters
	poolKey  string
	logger   *zap.Logger
}

// counters is the shared state: requests in flight per key.
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

// acquire takes a slot for key unless limit are in use; it returns whether it did.
func (c *counters) acquire(key string, limit int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byKey[key] >= limit {
		return false
	}
	c.byKey[key]++
	return true
}

// release gives a slot back; the entry is removed at zero.
func (c *counters) release(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := c.byKey[key]; n <= 1 {
		delete(c.byKey, key)
	} else {
		c.byKey[key] = n - 1
	}
}

// inFlight returns the requests in flight for key and the number of keys with any (for tests).
func (c *counters) inFlight(key string) (int, int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.byKey[key], len(c.byKey)
}

// ServeHTTP counts the request against its key for as long as the rest of the chain runs.
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
	if !h.counters.acquire(key, limit) {
		logRefusal(r)
		return h.refuse(w, limit)
	}
	defer h.counters.release(key)
	return next.ServeHTTP(w, r)
}

// RefusedLogField names the access-log field that carries the error code of a refusal; the gateway's
// Caddyfile sets the same field (log_append) for the refusals it answers itself, so log readers can
// count refusals by kind and tell this 429 from the rate limiter's.
const RefusedLogField = "refused"

// logRefusal adds `refused` to the request's access-log entry. The extra fields exist only inside
// Caddy's HTTP server: elsewhere (a bare handler in a test) there is nothing to add to.
func logRefusal(r *http.Request) {
	if extra, ok := r.Context().Value(caddyhttp.ExtraLogFieldsCtxKey).(*caddyhttp.ExtraLogFields); ok && extra != nil {
		extra.Add(zap.String(RefusedLogField, ErrorCode))
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

// refuse writes the 429 in the shape of OpenAI's API errors, as the gateway's other errors are.
func (h *Handler) refuse(w http.ResponseWriter, limit int) error {
	body, err := json.Marshal(openAIError{Error: openAIErrorBody{
		Message: fmt.Sprintf("Too many requests in flight for this API key (limit %d). Wait for one to finish; "+
			"retry after the number of seconds in the Retry-After header.", limit),
		Type: "requests",
		Code: ErrorCode,
	}})
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Retry-After", strconv.Itoa(h.RetryAfter))
	w.WriteHeader(http.StatusTooManyRequests)
	_, err = w.Write(body)
	return err
}

// UnmarshalCaddyfile reads
//
//	inflight_limit [<key> <limit>] {
//		key <placeholder>
//		limit <n|placeholder>
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
			return d.Errf("unknown inflight_limit option %q (key, limit, retry_after)", d.Val())
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
