// request_priority is a Caddy HTTP handler that sets the request's scheduling priority for the
// engine: the top-level integer "priority" of the JSON body, which vLLM started with
// --scheduling-policy priority schedules by (lower value first, ties by arrival; the field is in
// vLLM's chat, completions, responses and embeddings request models, int, default 0). Users within
// their fair share of the engine go first; a user running more than their share, and the batch lane,
// go after them.
//
// Caddyfile:
//
//	request_priority {
//		share        {teamserve_fair_share}       # sequences: an integer >= 0, or placeholder(s) giving one
//		in_flight    {inflight_limit.in_flight}   # the user's cost in flight with this request (the default)
//		lane         {teamserve_lane}             # optional: "batch" always gets max_priority
//		max_priority 10                           # the largest value written (default 10, >= 2)
//		replace_only                              # optional: add no "priority" member, replace the client's
//	}
//
//	request_priority <share>                       # the same, share given inline, other options default
//
// The priority, from in_flight (engine sequences the user has in flight including this request, as
// inflight_limit sets it at admission) and share (sequences), both read per request:
//
//	lane "batch"           max_priority
//	in_flight <= share     0
//	in_flight >  share     min(in_flight - share, max_priority - 1): 1 for one sequence over, and so on
//
// So among requests waiting for the batch, those of users within their share are scheduled first (by
// arrival), then the over-share ones, the furthest over last, then the batch lane's.
//
// A client never sets its own priority: every top-level "priority" member of a JSON object body is
// replaced with the computed integer (all of them, since the engine takes the last of repeated
// names), or one is added as the object's first member. Nothing else in the body changes: the other
// members, their order, spacing and number spellings are the client's bytes. Content-Length follows
// the new length; a chunked body stays chunked. vLLM also reads a priority from the X-Vllm-Priority
// request header ahead of the body's: the client's header is removed and the computed value sent in
// it as well. With replace_only, a body without a "priority" member is forwarded as the client sent
// it and only the header carries the value (vLLM's chat, completions and responses servers read the
// header first; its embeddings server reads only the body, so an embeddings request without the member
// runs at 0): for a gateway whose requests may go on to another OpenAI-compatible server that does not
// know the field (a fallback; strip the header there with header_up). A body that is not a JSON object (not application/json, invalid, an array) is forwarded
// unchanged; a JSON body in UTF-16/32 is refused with 400 (code unsupported_encoding), since the
// engine would decode it and the gateway would not have replaced its priority. The value is also set
// as the placeholder {request_priority}, e.g. for log_append.
//
// Beam search: vLLM 0.32 runs a request with use_beam_search (true as pydantic reads it) as one engine
// request per beam and step, none of them with the request's priority (entrypoints/generate/beam_search/
// online.py), so it would run ahead of its lane. Such a request is served only when its priority is 0;
// otherwise it is refused with 400 unsupported_field naming use_beam_search. Its beams are n, which
// request_cost already charges.
//
// A priority other than 0 is an error for an engine without --scheduling-policy priority: use this
// handler only in front of such an engine (not in front of a fallback that does not know the field).
//
// Order: after inflight_limit (which sets in_flight), before reverse_proxy. The body is read at most
// max_size bytes (default 64 MiB; larger: 413), once per request with request_model and request_cost
// (body.go). Cost: a JSON validity pass, a walk of the top-level members and one copy of the body.
// An in_flight or share that gives no usable number is a configuration error: 500, logged, and the
// request is not forwarded.

package gateway

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// BatchLane is the lane whose requests always get the largest priority value.
const BatchLane = "batch"

// PriorityHeader is the request header vLLM reads a priority from ahead of the body's.
const PriorityHeader = "X-Vllm-Priority"

// PriorityPlaceholder is the placeholder request_priority sets to the value it wrote.
const PriorityPlaceholder = "request_priority"

// DefaultMaxPriority is max_priority unless configured.
const DefaultMaxPriority = 10

func init() {
	caddy.RegisterModule(RequestPriority{})
	httpcaddyfile.RegisterHandlerDirective("request_priority", parseRequestPriorityCaddyfile)
	// Outside a `route` block: just before reverse_proxy, which is also where inflight_limit is
	// registered (inflight.go); its init runs first (files initialise in name order), so this lands
	// between the two: inflight_limit, request_priority, reverse_proxy. Inside a route, as written.
	httpcaddyfile.RegisterDirectiveOrder("request_priority", httpcaddyfile.Before, "reverse_proxy")
}

// RequestPriority sets the JSON body's "priority" from the user's in-flight cost and fair share.
type RequestPriority struct {
	// Share is the user's fair share of the engine, in sequences: an integer >= 0, or placeholders
	// that expand to one per request. Required.
	Share string `json:"share,omitempty"`
	// InFlight is the user's cost in flight including this request, in sequences: placeholders that
	// expand to an integer >= 0 per request. Default "{inflight_limit.in_flight}".
	InFlight string `json:"in_flight,omitempty"`
	// Lane, if set, is placeholders naming the request's lane; "batch" gets MaxPriority.
	Lane string `json:"lane,omitempty"`
	// MaxPriority is the largest priority written (the batch lane's); over-share requests get at most
	// MaxPriority-1. Default DefaultMaxPriority; at least 2.
	MaxPriority int `json:"max_priority,omitempty"`
	// MaxSize is the most body bytes read; a larger body is refused with 413. Default DefaultBodyMax.
	MaxSize int64 `json:"max_size,omitempty"`
	// ReplaceOnly: replace the body's "priority" members but add none (the header carries the value).
	ReplaceOnly bool `json:"replace_only,omitempty"`

	logger *zap.Logger
}

// CaddyModule returns the Caddy module information.
func (RequestPriority) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.request_priority",
		New: func() caddy.Module { return new(RequestPriority) },
	}
}

// Provision checks the configuration and fills in the defaults.
func (p *RequestPriority) Provision(ctx caddy.Context) error {
	p.logger = ctx.Logger()
	if p.InFlight == "" {
		p.InFlight = "{" + InFlightPlaceholder + "}"
	}
	if p.MaxPriority == 0 {
		p.MaxPriority = DefaultMaxPriority
	}
	if p.MaxSize == 0 {
		p.MaxSize = DefaultBodyMax
	}
	return p.Validate()
}

// Validate reports configuration errors (also run by Provision).
func (p *RequestPriority) Validate() error {
	if strings.TrimSpace(p.Share) == "" {
		return fmt.Errorf("request_priority: share is required (sequences: an integer >= 0 or a placeholder)")
	}
	if !strings.Contains(p.Share, "{") {
		if _, err := parseCount(p.Share); err != nil {
			return fmt.Errorf("request_priority: share %q: %v", p.Share, err)
		}
	}
	if p.InFlight != "" && !strings.Contains(p.InFlight, "{") {
		return fmt.Errorf("request_priority: in_flight %q must be a placeholder, e.g. {%s}", p.InFlight, InFlightPlaceholder)
	}
	if p.MaxPriority != 0 && p.MaxPriority < 2 {
		return fmt.Errorf("request_priority: max_priority %d must be >= 2 (0 within the share, 1.. over it, the largest for the batch lane)", p.MaxPriority)
	}
	if p.MaxSize < 0 {
		return fmt.Errorf("request_priority: max_size %d must be >= 1 byte", p.MaxSize)
	}
	return nil
}

// parseCount reads an integer >= 0.
func parseCount(s string) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		return 0, fmt.Errorf("not an integer")
	}
	if n < 0 {
		return 0, fmt.Errorf("must be >= 0")
	}
	return n, nil
}

// priority computes the value for a request (see the file comment).
func (p *RequestPriority) priority(repl *caddy.Replacer) (int, error) {
	if p.Lane != "" && strings.TrimSpace(repl.ReplaceAll(p.Lane, "")) == BatchLane {
		return p.MaxPriority, nil
	}
	inFlightText := repl.ReplaceAll(p.InFlight, "")
	inFlight, err := parseCount(inFlightText)
	if err != nil {
		return 0, fmt.Errorf("request_priority: in_flight %q (from %s): %v; is inflight_limit before this handler?", inFlightText, p.InFlight, err)
	}
	shareText := repl.ReplaceAll(p.Share, "")
	share, err := parseCount(shareText)
	if err != nil {
		return 0, fmt.Errorf("request_priority: share %q (from %s): %v", shareText, p.Share, err)
	}
	if over := inFlight - share; over > 0 {
		return min(over, p.MaxPriority-1), nil
	}
	return 0, nil
}

// ServeHTTP writes the priority into the request and calls the next handler.
func (p *RequestPriority) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	priority, err := p.priority(repl)
	if err != nil {
		p.logger.Error("request_priority: unusable input", zap.Error(err))
		return caddyhttp.Error(http.StatusInternalServerError, err)
	}
	value := strconv.Itoa(priority)
	repl.Set(PriorityPlaceholder, priority)
	r.Header.Set(PriorityHeader, value) // replaces every value the client sent, whatever its case

	if !hasJSONBody(r) {
		return next.ServeHTTP(w, r)
	}
	body, err := bufferedBody(r, p.MaxSize)
	if err != nil {
		return bodyReadError("request_priority", p.MaxSize, err, p.logger)
	}
	doc, prefix, kind := engineJSON(body)
	switch kind {
	case docNotUTF8:
		return refuseNotUTF8(w, r)
	case docObject:
		if beam, _ := engineBool(lastMember(doc, "use_beam_search")); beam && priority > 0 {
			logRefusal(r, CodeUnsupportedField)
			return writeOpenAIError(w, http.StatusBadRequest, fmt.Sprintf("Beam search is served only to requests "+
				"that run first: the engine runs each beam step as a request of its own at the first priority, "+
				"and this request would wait behind others at priority %d (your lane, or more of your sequences "+
				"in flight than your fair share). Send it without use_beam_search, or when fewer of your "+
				"requests are in flight.", priority), "invalid_request_error", "use_beam_search", CodeUnsupportedField, 0)
		}
		if p.ReplaceOnly && !hasMember(doc, "priority") {
			break
		}
		replaceDoc(r, body, prefix, withMember(doc, "priority", []byte(value)))
	}
	return next.ServeHTTP(w, r)
}

// hasMember reports whether the JSON object doc has a top-level member called name.
func hasMember(doc []byte, name string) bool {
	found := false
	members(doc, func(m member) {
		found = found || isName(m.name, name)
	})
	return found
}

// UnmarshalCaddyfile reads
//
//	request_priority [<share>] [{
//		share <n|placeholder>
//		in_flight <placeholder>
//		lane <placeholder>
//		max_priority <n>
//		max_size <bytes>
//		replace_only
//	}]
func (p *RequestPriority) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive name
	args := d.RemainingArgs()
	switch len(args) {
	case 0:
	case 1:
		p.Share = args[0]
	default:
		return d.Errf("request_priority takes either no arguments or <share>, got %d", len(args))
	}
	for d.NextBlock(0) {
		option := d.Val()
		if option == "replace_only" {
			if d.NextArg() {
				return d.ArgErr()
			}
			p.ReplaceOnly = true
			continue
		}
		if !d.NextArg() {
			return d.ArgErr()
		}
		value := d.Val()
		switch option {
		case "share":
			p.Share = value
		case "in_flight":
			p.InFlight = value
		case "lane":
			p.Lane = value
		case "max_priority":
			n, err := strconv.Atoi(value)
			if err != nil || n < 2 {
				return d.Errf("max_priority %q must be a whole number >= 2", value)
			}
			p.MaxPriority = n
		case "max_size":
			n, err := strconv.ParseInt(value, 10, 64)
			if err != nil || n < 1 {
				return d.Errf("max_size %q must be a whole number of bytes >= 1", value)
			}
			p.MaxSize = n
		default:
			return d.Errf("unknown request_priority option %q (share, in_flight, lane, max_priority, max_size, replace_only)", option)
		}
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	if p.Share == "" {
		return d.Err("request_priority needs a share (sequences: an integer >= 0 or a placeholder)")
	}
	return nil
}

func parseRequestPriorityCaddyfile(helper httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	p := new(RequestPriority)
	err := p.UnmarshalCaddyfile(helper.Dispenser)
	return p, err
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*RequestPriority)(nil)
	_ caddy.Validator             = (*RequestPriority)(nil)
	_ caddyhttp.MiddlewareHandler = (*RequestPriority)(nil)
	_ caddyfile.Unmarshaler       = (*RequestPriority)(nil)
)
