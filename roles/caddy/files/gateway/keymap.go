// api_key_map is a Caddy HTTP handler that turns the request's bearer key into placeholders (for
// teamserve: the user's name, key expiry, in-flight cap and rate-limit tier), like Caddy's `map`
// directive with {header.Authorization} as the source, with two differences:
//
//   - the config holds each key's SHA-256, never the key, so the Caddyfile and `caddy adapt` output
//     give nobody a working key;
//   - the lookup is one SHA-256 and one hash-table access per request, whatever the number of keys
//     (Caddy v2.11.9's map scans its mappings in order each time a destination placeholder is read).
//
// Caddyfile:
//
//	api_key_map {user} {expires} {max_inflight} {tier} {
//		<sha256 of the key, 64 lowercase hex digits> alice 0 2 tier-1
//		default "" 0 1 ""
//	}
//
// The key is what follows "Bearer " in the request's only Authorization header (the scheme name is
// case-insensitive: RFC 9110 section 11.1, RFC 6750 section 2.1). A missing key, another scheme, two
// Authorization headers or an unknown key all get the defaults. Every destination is set on every
// request, so nothing from a client's own headers can stand in for a value.
//
// On behalf of: a gateway that passes requests on (a front gateway in front of this box) names the
// person it authenticated in a request header, and only its own key may do so:
//
//	api_key_map {user} {expires} {max_inflight} {tier} {
//		<sha256 of the front's key> teamserve-front 0 16 tier-0
//		on_behalf_of X-Teamserve-Person teamserve-front {
//			alice alice 0 8 ""
//			bob bob 0 2 ""
//		}
//	}
//
// A request whose key maps to the user named after the header (the first destination's output) and
// whose only value of that header names a listed person gets the person's outputs instead of the key's,
// and {api_key_map.on_behalf_of} is that user's name; any other request keeps its own key's outputs,
// and a header naming nobody listed leaves the key's own (the hop is served as itself). The header is
// removed from every request, so no other caller's header reaches a handler or the engine.
//
// A fast hash is enough here because the keys are long random strings (the caddy role issues 48
// alphanumerics, about 285 bits): a slow, salted password hash exists for secrets a person chose,
// which can be guessed from a dictionary; a 285-bit random key cannot.

package gateway

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(KeyMap{})
	httpcaddyfile.RegisterHandlerDirective("api_key_map", parseKeyMapCaddyfile)
	// Where Caddy orders `map`: before every directive that could read the placeholders it sets.
	httpcaddyfile.RegisterDirectiveOrder("api_key_map", httpcaddyfile.After, "map")
}

// KeyMap maps the SHA-256 of the request's bearer key to placeholder values.
type KeyMap struct {
	// Destinations are the placeholders to set, each written in braces, e.g. "{teamserve_user}".
	Destinations []string `json:"destinations,omitempty"`
	// Keys are the known keys: each key's SHA-256 and one output per destination.
	Keys []KeyMapping `json:"keys,omitempty"`
	// Defaults are the values for a request without a known key: one per destination (all "" if
	// empty).
	Defaults []string `json:"defaults,omitempty"`

	// OnBehalfOf, if set, lets one user's requests name the person they are for (see the file comment).
	OnBehalfOf *OnBehalfOf `json:"on_behalf_of,omitempty"`

	names []string
	index map[[sha256.Size]byte][]string
}

// OnBehalfOf is the persons a hop (a front gateway) may name, and how.
type OnBehalfOf struct {
	// Header is the request header that names the person.
	Header string `json:"header"`
	// User is the first destination's output for the hop's key (its user name).
	User string `json:"user"`
	// Persons maps a person's name to one output per destination.
	Persons map[string][]string `json:"persons"`
}

// OnBehalfOfPlaceholder is set to the hop's user name when a request is taken as its person's, "" otherwise.
const OnBehalfOfPlaceholder = "api_key_map.on_behalf_of"

// KeyMapping is one known key.
type KeyMapping struct {
	// SHA256 is the SHA-256 of the key (the part after "Bearer "), as 64 lowercase hex digits.
	SHA256 string `json:"sha256"`
	// Outputs has one value per destination, in the same order.
	Outputs []string `json:"outputs"`
}

// CaddyModule returns the Caddy module information.
func (KeyMap) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.api_key_map",
		New: func() caddy.Module { return new(KeyMap) },
	}
}

// Provision checks the configuration and builds the hash table.
func (m *KeyMap) Provision(_ caddy.Context) error {
	if err := m.Validate(); err != nil {
		return err
	}
	m.names = make([]string, len(m.Destinations))
	for i, dest := range m.Destinations {
		m.names[i] = dest[1 : len(dest)-1]
	}
	if len(m.Defaults) == 0 {
		m.Defaults = make([]string, len(m.Destinations))
	}
	m.index = make(map[[sha256.Size]byte][]string, len(m.Keys))
	for _, k := range m.Keys {
		var sum [sha256.Size]byte
		_, _ = hex.Decode(sum[:], []byte(k.SHA256)) // checked by Validate
		m.index[sum] = k.Outputs
	}
	return nil
}

// Validate reports configuration errors (also run by Provision). Errors name the entry by its
// position and the start of its hash, which is not secret.
func (m *KeyMap) Validate() error {
	if len(m.Destinations) == 0 {
		return fmt.Errorf("api_key_map: at least one destination placeholder is required, e.g. {user}")
	}
	for i, dest := range m.Destinations {
		if len(dest) < 3 || dest[0] != '{' || dest[len(dest)-1] != '}' || strings.Count(dest, "{") != 1 ||
			strings.Count(dest, "}") != 1 {
			return fmt.Errorf("api_key_map: destination %d (%q) must be one placeholder in braces, e.g. {user}", i, dest)
		}
	}
	if len(m.Defaults) != 0 && len(m.Defaults) != len(m.Destinations) {
		return fmt.Errorf("api_key_map: %d defaults for %d destinations", len(m.Defaults), len(m.Destinations))
	}
	if o := m.OnBehalfOf; o != nil {
		if o.Header == "" || o.User == "" {
			return fmt.Errorf("api_key_map: on_behalf_of needs a header and a user, got %q and %q", o.Header, o.User)
		}
		for person, outputs := range o.Persons {
			if len(outputs) != len(m.Destinations) {
				return fmt.Errorf("api_key_map: on_behalf_of person %q has %d outputs for %d destinations",
					person, len(outputs), len(m.Destinations))
			}
		}
	}
	seen := make(map[string]int, len(m.Keys))
	for i, k := range m.Keys {
		if len(k.SHA256) != 2*sha256.Size || strings.ToLower(k.SHA256) != k.SHA256 {
			return fmt.Errorf("api_key_map: key %d: sha256 must be 64 lowercase hex digits, got %d characters",
				i, len(k.SHA256))
		}
		if _, err := hex.DecodeString(k.SHA256); err != nil {
			return fmt.Errorf("api_key_map: key %d: sha256 is not hex: %v", i, err)
		}
		if prev, dup := seen[k.SHA256]; dup {
			return fmt.Errorf("api_key_map: key %d (sha256 %s...) repeats key %d", i, k.SHA256[:8], prev)
		}
		seen[k.SHA256] = i
		if len(k.Outputs) != len(m.Destinations) {
			return fmt.Errorf("api_key_map: key %d (sha256 %s...) has %d outputs for %d destinations",
				i, k.SHA256[:8], len(k.Outputs), len(m.Destinations))
		}
	}
	return nil
}

// bearerKey returns the key of a request with exactly one "Authorization: Bearer <key>" header.
func bearerKey(r *http.Request) (string, bool) {
	values := r.Header.Values("Authorization")
	if len(values) != 1 {
		return "", false
	}
	const scheme = "Bearer "
	v := values[0]
	if len(v) <= len(scheme) || !strings.EqualFold(v[:len(scheme)], scheme) {
		return "", false
	}
	return v[len(scheme):], true
}

// lookup returns the outputs for the request's key, or the defaults, and the hop's user name when the
// outputs are the person's it named.
func (m *KeyMap) lookup(r *http.Request) ([]string, string) {
	out := m.Defaults
	if key, ok := bearerKey(r); ok {
		if known, found := m.index[sha256.Sum256([]byte(key))]; found {
			out = known
		}
	}
	o := m.OnBehalfOf
	if o == nil {
		return out, ""
	}
	named := r.Header.Values(o.Header)
	r.Header.Del(o.Header)
	if len(out) == 0 || out[0] != o.User || len(named) != 1 {
		return out, ""
	}
	if person, found := o.Persons[named[0]]; found {
		return person, o.User
	}
	return out, ""
}

// ServeHTTP sets every destination placeholder and calls the next handler.
func (m *KeyMap) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	outputs, via := m.lookup(r)
	for i, value := range outputs {
		repl.Set(m.names[i], value)
	}
	if m.OnBehalfOf != nil {
		repl.Set(OnBehalfOfPlaceholder, via)
	}
	return next.ServeHTTP(w, r)
}

// UnmarshalCaddyfile reads
//
//	api_key_map <destinations...> {
//		<sha256> <outputs...>
//		default <defaults...>
//		on_behalf_of <header> <user> {
//			<person> <outputs...>
//		}
//	}
func (m *KeyMap) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive name
	m.Destinations = d.RemainingArgs()
	if len(m.Destinations) == 0 {
		return d.Err("api_key_map needs at least one destination placeholder, e.g. {user}")
	}
	seenDefault := false
	for d.NextBlock(0) {
		first := d.Val()
		outputs := d.RemainingArgs()
		if first == "on_behalf_of" {
			if m.OnBehalfOf != nil {
				return d.Err("api_key_map: on_behalf_of given twice")
			}
			if len(outputs) != 2 {
				return d.Errf("api_key_map: on_behalf_of takes <header> <user>, got %d arguments", len(outputs))
			}
			o := &OnBehalfOf{Header: outputs[0], User: outputs[1], Persons: map[string][]string{}}
			for nesting := d.Nesting(); d.NextBlock(nesting); {
				person := d.Val()
				if _, dup := o.Persons[person]; dup {
					return d.Errf("api_key_map: on_behalf_of person %q given twice", person)
				}
				o.Persons[person] = d.RemainingArgs()
			}
			m.OnBehalfOf = o
			continue
		}
		if first == "default" {
			if seenDefault {
				return d.Err("api_key_map: default given twice")
			}
			if len(outputs) == 0 {
				return d.Err("api_key_map: default needs one value per destination (write \"\" for empty)")
			}
			seenDefault, m.Defaults = true, outputs
			continue
		}
		m.Keys = append(m.Keys, KeyMapping{SHA256: first, Outputs: outputs})
	}
	return nil
}

func parseKeyMapCaddyfile(helper httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	m := new(KeyMap)
	err := m.UnmarshalCaddyfile(helper.Dispenser)
	return m, err
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*KeyMap)(nil)
	_ caddy.Validator             = (*KeyMap)(nil)
	_ caddyhttp.MiddlewareHandler = (*KeyMap)(nil)
	_ caddyfile.Unmarshaler       = (*KeyMap)(nil)
)
