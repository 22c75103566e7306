// request_model is a Caddy HTTP handler that sets a placeholder to the "model" field of the request's
// JSON body, so that matchers can route on it. For teamserve: a front gateway whose boxes serve
// different models sends each OpenAI-style request (chat, completions, embeddings...) to the boxes
// that serve the model it names.
//
// Caddy v2.11.9 has no matcher for a field of a JSON body: {http.request.body} is the whole body as a
// string, which a `vars` or `expression` matcher can only compare whole or scan with a regexp, and a
// regexp cannot tell the top-level "model" from a "model" inside a message or a tool's arguments.
//
// Caddyfile:
//
//	request_model {teamserve_model}
//
//	request_model {teamserve_model} {
//		max_size 67108864    # bytes read at most; a larger body gets 413 (default 64 MiB)
//	}
//
// The destination is one placeholder in braces, set the way api_key_map sets its destinations, so it
// is read as {teamserve_model} anywhere placeholders are (`vars {teamserve_model} "my-model"` matchers,
// log_append, header values).
//
// For a request with a body and Content-Type application/json (parameters such as charset ignored), the
// body is read into memory, the "model" member of its top-level object is looked up, and the body is
// put back byte for byte so the proxy forwards exactly what the client sent (Content-Length unchanged;
// a chunked body stays chunked). The value is "" when the member is absent or not a string, when the
// body is not valid JSON or not an object, and for every other request. The placeholder is set on every
// request, before anything else, so nothing earlier in the chain or from the client stands in for it.
//
// Order: after request_body, whose max_size bounds the read (its 413 passes through unchanged), and
// before the handlers that match on the value. A body larger than max_size here is refused with 413
// too, before more than max_size+1 bytes are read. The body is held in memory for the request's
// lifetime, once: the lookup walks it in place without decoding the rest of it, and request_cost and
// request_priority later in the chain use the same buffer rather than reading it again (body.go).
// Cost: a JSON validity pass and that walk, a few milliseconds per MiB of body.

package gateway

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// DefaultModelBodyMax is the most body bytes request_model reads unless max_size says otherwise: far
// above any text prompt a model's context holds (the gateway's request_body max_size is the tighter
// bound), and a ceiling on the memory one request can take if that bound is missing.
const DefaultModelBodyMax = 64 << 20

func init() {
	caddy.RegisterModule(RequestModel{})
	httpcaddyfile.RegisterHandlerDirective("request_model", parseRequestModelCaddyfile)
	// Outside a `route` block: right after request_body, so its max_size wraps the body before this
	// reads it, and before every directive that could match on the value (rewrite, handle, route,
	// reverse_proxy...). Inside a route, the order is as written.
	httpcaddyfile.RegisterDirectiveOrder("request_model", httpcaddyfile.After, "request_body")
}

// RequestModel sets a placeholder to the request body's top-level "model" string.
type RequestModel struct {
	// Destination is the placeholder to set, in braces, e.g. "{teamserve_model}". Required.
	Destination string `json:"destination,omitempty"`
	// MaxSize is the most body bytes read; a larger body is refused with 413. Default
	// DefaultModelBodyMax.
	MaxSize int64 `json:"max_size,omitempty"`

	name   string
	logger *zap.Logger
}

// CaddyModule returns the Caddy module information.
func (RequestModel) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.request_model",
		New: func() caddy.Module { return new(RequestModel) },
	}
}

// Provision checks the configuration and fills in the default size bound.
func (m *RequestModel) Provision(ctx caddy.Context) error {
	m.logger = ctx.Logger()
	if err := m.Validate(); err != nil {
		return err
	}
	m.name = m.Destination[1 : len(m.Destination)-1]
	if m.MaxSize == 0 {
		m.MaxSize = DefaultModelBodyMax
	}
	return nil
}

// Validate reports configuration errors (also run by Provision).
func (m *RequestModel) Validate() error {
	if err := checkPlaceholder(m.Destination); err != nil {
		return fmt.Errorf("request_model: %v", err)
	}
	if m.MaxSize < 0 {
		return fmt.Errorf("request_model: max_size %d must be >= 1 byte", m.MaxSize)
	}
	return nil
}

// checkPlaceholder accepts one placeholder in braces, as api_key_map's destinations are.
func checkPlaceholder(dest string) error {
	if len(dest) < 3 || dest[0] != '{' || dest[len(dest)-1] != '}' || strings.Count(dest, "{") != 1 ||
		strings.Count(dest, "}") != 1 || strings.ContainsAny(dest, " \t\r\n") {
		return fmt.Errorf("destination %q must be one placeholder in braces, e.g. {teamserve_model}", dest)
	}
	return nil
}

// ServeHTTP sets the destination and calls the next handler with the body intact.
func (m *RequestModel) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	// First, so an error route or a refusal below sees "" rather than an older value.
	repl.Set(m.name, "")
	if !hasJSONBody(r) {
		return next.ServeHTTP(w, r)
	}
	// Read once per request, by whichever of request_model, request_cost and request_priority comes
	// first (body.go).
	body, err := bufferedBody(r, m.MaxSize)
	if err != nil {
		return bodyReadError("request_model", m.MaxSize, err, m.logger)
	}
	repl.Set(m.name, modelField(body))
	return next.ServeHTTP(w, r)
}

// modelField returns the top-level "model" member of doc if doc is a JSON object and that member is a
// string; otherwise "". Member names are matched exactly after JSON unescaping, as the engine (Python)
// reads them; of repeated names the last counts, as there too. Only the member names and the model
// value are decoded: the other values (the messages) are skipped in place.
func modelField(doc []byte) string {
	if !json.Valid(doc) {
		return ""
	}
	// From here doc is known to be valid JSON, so the walk needs no error handling; the bounds checks
	// only keep a mistake from becoming a panic.
	i := skipSpace(doc, 0)
	if i >= len(doc) || doc[i] != '{' {
		return ""
	}
	model := ""
	i++
	for {
		i = skipSpace(doc, i)
		if i >= len(doc) || doc[i] != '"' {
			return model // the '}' of an empty object
		}
		keyEnd := stringEnd(doc, i)
		key := doc[i:keyEnd]
		i = skipSpace(doc, keyEnd) + 1 // past ':'
		i = skipSpace(doc, i)
		valueEnd := valueEnd(doc, i)
		if isModelName(key) {
			model = stringValue(doc[min(i, valueEnd):valueEnd])
		}
		i = skipSpace(doc, valueEnd)
		if i >= len(doc) || doc[i] != ',' {
			return model // '}'
		}
		i++
	}
}

func skipSpace(doc []byte, i int) int {
	for i < len(doc) {
		switch doc[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// stringEnd returns the index just past the string that opens at doc[i]. It jumps from quote to quote
// (a fast byte search), and a quote ends the string unless an odd number of backslashes precede it.
func stringEnd(doc []byte, i int) int {
	for j := i + 1; j < len(doc); {
		k := bytes.IndexByte(doc[j:], '"')
		if k < 0 {
			break
		}
		quote := j + k
		backslashes := 0
		for p := quote - 1; p > i && doc[p] == '\\'; p-- {
			backslashes++
		}
		if backslashes%2 == 0 {
			return quote + 1
		}
		j = quote + 1
	}
	return len(doc)
}

// valueEnd returns the index just past the value that starts at doc[i].
func valueEnd(doc []byte, i int) int {
	if i >= len(doc) {
		return len(doc)
	}
	switch doc[i] {
	case '"':
		return stringEnd(doc, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(doc); {
			switch doc[j] {
			case '"':
				j = stringEnd(doc, j)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1
				}
			}
			j++
		}
		return len(doc)
	default: // number, true, false, null
		for j := i; j < len(doc); j++ {
			switch doc[j] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return j
			}
		}
		return len(doc)
	}
}

// isModelName reports whether the quoted member name key is "model", escapes (\u006d...) included.
func isModelName(key []byte) bool {
	if string(key) == `"model"` {
		return true
	}
	if bytes.IndexByte(key, '\\') < 0 {
		return false
	}
	var name string
	return json.Unmarshal(key, &name) == nil && name == "model"
}

// stringValue decodes raw if it is a JSON string, else "".
func stringValue(raw []byte) string {
	if len(raw) < 2 || raw[0] != '"' {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return ""
	}
	return s
}

// UnmarshalCaddyfile reads
//
//	request_model <destination> [{
//		max_size <bytes>
//	}]
func (m *RequestModel) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	dest, maxSize, err := unmarshalBodyReader(d, "request_model", "{teamserve_model}")
	if err != nil {
		return err
	}
	m.Destination, m.MaxSize = dest, maxSize
	return nil
}

func parseRequestModelCaddyfile(helper httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	m := new(RequestModel)
	err := m.UnmarshalCaddyfile(helper.Dispenser)
	return m, err
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*RequestModel)(nil)
	_ caddy.Validator             = (*RequestModel)(nil)
	_ caddyhttp.MiddlewareHandler = (*RequestModel)(nil)
	_ caddyfile.Unmarshaler       = (*RequestModel)(nil)
)
