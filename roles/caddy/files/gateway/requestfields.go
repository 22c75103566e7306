// request_fields is a Caddy HTTP handler that decides which top-level members of a JSON request body
// reach the engine: members that steer the engine's internals are refused, members the engine would
// run without accounting for them are refused when true, and members the gateway owns are written by
// it, never by the client.
//
// Caddyfile (inside the route, before reverse_proxy; a matcher limits it to some paths or callers):
//
//	request_fields [<matcher>] {
//		refuse      <name>...          # 400 unsupported_field naming the member, whatever its value
//		refuse_true <name>...          # 400 unsupported_field when the engine would read it as true
//		set         <name> <value>     # the member becomes the JSON string <value> (placeholders
//		                               # expanded); a value that expands to "" removes the member
//		max_size    <bytes>            # the most request body bytes read (default 64 MiB; larger: 413)
//	}
//
// Names are compared as the engine compares them: after unescaping ("\u0062ackground" is
// "background"), every repeated member counting; "true" is what pydantic accepts as true (engineBool).
// A refusal names the first offending member, in the body's order, and is logged as
// "refused": "unsupported_field". set replaces every member of that name (the engine keeps the last)
// or adds one as the first member; every other byte of the body stays the client's. A body that is
// not a JSON object is forwarded unchanged (the engine answers its own 400 or 422); a JSON body in
// UTF-16/32 is refused with 400 unsupported_encoding, as request_priority does, since the gateway would
// not have read its members.
//
// Why these members (vLLM 0.32's request models): kv_transfer_params and vllm_xargs reach the KV
// connector and the engine's extension arguments; request_id names the engine's request (another
// person's could collide with it); background on /v1/responses runs the request after the answer,
// whose usage is then null, so its tokens would count against nobody; cache_salt scopes the prefix
// cache, which is the gateway's to decide per person.

package gateway

import (
	"fmt"
	"net/http"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// CodeUnsupportedField is the error code (and access-log "refused" value) of a refused member.
const CodeUnsupportedField = "unsupported_field"

func init() {
	caddy.RegisterModule(RequestFields{})
	httpcaddyfile.RegisterHandlerDirective("request_fields", parseRequestFieldsCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("request_fields", httpcaddyfile.Before, "reverse_proxy")
}

// RequestFields refuses and sets top-level members of a JSON request body.
type RequestFields struct {
	// Refuse names members refused whatever their value.
	Refuse []string `json:"refuse,omitempty"`
	// RefuseTrue names members refused when the engine would read them as true.
	RefuseTrue []string `json:"refuse_true,omitempty"`
	// Set maps a member name to the string it gets (placeholders expanded per request; "" removes it).
	Set map[string]string `json:"set,omitempty"`
	// MaxSize is the most body bytes read; a larger body is refused with 413. Default DefaultBodyMax.
	MaxSize int64 `json:"max_size,omitempty"`

	logger *zap.Logger
}

// CaddyModule returns the Caddy module information.
func (RequestFields) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.request_fields",
		New: func() caddy.Module { return new(RequestFields) },
	}
}

// Provision fills in the defaults.
func (f *RequestFields) Provision(ctx caddy.Context) error {
	f.logger = ctx.Logger()
	if f.MaxSize == 0 {
		f.MaxSize = DefaultBodyMax
	}
	return f.Validate()
}

// Validate reports configuration errors (also run by Provision).
func (f *RequestFields) Validate() error {
	if f.MaxSize < 0 {
		return fmt.Errorf("request_fields: max_size %d must be >= 1 byte", f.MaxSize)
	}
	for _, name := range append(append([]string{}, f.Refuse...), f.RefuseTrue...) {
		if _, set := f.Set[name]; set {
			return fmt.Errorf("request_fields: %q is both refused and set", name)
		}
	}
	return nil
}

// ServeHTTP refuses or rewrites the body, then calls the next handler.
func (f *RequestFields) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	if !hasJSONBody(r) {
		return next.ServeHTTP(w, r)
	}
	body, err := bufferedBody(r, f.MaxSize)
	if err != nil {
		return bodyReadError("request_fields", f.MaxSize, err, f.logger)
	}
	doc, prefix, kind := engineJSON(body)
	switch kind {
	case docNotUTF8:
		return refuseNotUTF8(w, r)
	case docObject:
	default:
		return next.ServeHTTP(w, r)
	}
	if name, why := f.refused(doc); name != "" {
		logRefusal(r, CodeUnsupportedField)
		return writeOpenAIError(w, http.StatusBadRequest, fmt.Sprintf("The field %q is not accepted by this gateway: %s. "+
			"Send the request without it.", name, why), "invalid_request_error", name, CodeUnsupportedField, 0)
	}
	if len(f.Set) == 0 {
		return next.ServeHTTP(w, r)
	}
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	rewritten := doc
	for name, value := range f.Set {
		if text := repl.ReplaceAll(value, ""); text != "" {
			rewritten = withMember(rewritten, name, strconv.AppendQuote(nil, text))
		} else if hasMember(rewritten, name) {
			rewritten = withoutMember(rewritten, name)
		}
	}
	replaceDoc(r, body, prefix, rewritten)
	return next.ServeHTTP(w, r)
}

// refused returns the first member of doc that is refused, in the body's order, and why; "" if none.
func (f *RequestFields) refused(doc []byte) (name, why string) {
	members(doc, func(m member) {
		if name != "" {
			return
		}
		for _, refused := range f.Refuse {
			if isName(m.name, refused) {
				name, why = refused, "it steers the engine's internals, which are the gateway's to set"
				return
			}
		}
		for _, refused := range f.RefuseTrue {
			if isName(m.name, refused) {
				if on, _ := engineBool(doc[m.start:m.end]); on {
					name, why = refused, "with it the engine would run the request outside what the gateway counts and schedules for your key"
					return
				}
			}
		}
	})
	return name, why
}

// UnmarshalCaddyfile reads
//
//	request_fields {
//		refuse <name>...
//		refuse_true <name>...
//		set <name> <value>
//		max_size <bytes>
//	}
func (f *RequestFields) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		option := d.Val()
		args := d.RemainingArgs()
		switch option {
		case "refuse", "refuse_true":
			if len(args) == 0 {
				return d.Errf("%s needs at least one member name", option)
			}
			if option == "refuse" {
				f.Refuse = append(f.Refuse, args...)
			} else {
				f.RefuseTrue = append(f.RefuseTrue, args...)
			}
		case "set":
			if len(args) != 2 {
				return d.Errf("set takes <name> <value>, got %d arguments", len(args))
			}
			if f.Set == nil {
				f.Set = map[string]string{}
			}
			f.Set[args[0]] = args[1]
		case "max_size":
			if len(args) != 1 {
				return d.ArgErr()
			}
			n, err := strconv.ParseInt(args[0], 10, 64)
			if err != nil || n < 1 {
				return d.Errf("max_size %q must be a whole number of bytes >= 1", args[0])
			}
			f.MaxSize = n
		default:
			return d.Errf("unknown request_fields option %q (refuse, refuse_true, set, max_size)", option)
		}
	}
	if len(f.Refuse)+len(f.RefuseTrue)+len(f.Set) == 0 {
		return d.Err("request_fields needs refuse, refuse_true or set")
	}
	return nil
}

func parseRequestFieldsCaddyfile(helper httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	f := new(RequestFields)
	err := f.UnmarshalCaddyfile(helper.Dispenser)
	return f, err
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*RequestFields)(nil)
	_ caddy.Validator             = (*RequestFields)(nil)
	_ caddyhttp.MiddlewareHandler = (*RequestFields)(nil)
	_ caddyfile.Unmarshaler       = (*RequestFields)(nil)
)
