// capacity is a reverse_proxy selection policy (lb_policy) that spreads requests over upstreams in
// proportion to each one's planned capacity, and never sends one past it. For teamserve: a front
// gateway's pool of boxes, each box's cap being the batch its engine was planned for.
//
// Caddy v2.11.9's least_conn compares raw request counts, so a box planned for 8 concurrent sequences
// gets as many requests as one planned for 16; and no Caddyfile option sets a per-upstream cap
// (unhealthy_request_count is one number for the whole pool). This policy is least_conn weighted by
// each box's cap, with the cap as a hard bound at selection.
//
// Caddyfile:
//
//	reverse_proxy https://10.0.0.1:8443 https://10.0.0.2:8443 {
//		lb_policy capacity {
//			cap 10.0.0.1:8443 8      # an upstream's dial address and its in-flight cap (integer >= 1)
//			cap 10.0.0.2:8443 16
//			hash {teamserve_user}    # optional: placeholders naming a sticky key
//		}
//	}
//
// The dial address is the upstream as Caddy dials it (reverseproxy.Upstream.Dial): host:port, with the
// scheme's default port filled in and IPv6 hosts in brackets ("[fd00::1]:8443"), or unix/<path>.
//
// Candidates are the upstreams that are Available() (healthy, and under any max_requests or
// unhealthy_request_count) and, if they have a cap, have fewer than cap requests in flight.
//
//   - Without hash, or when the hash key expands to "": the candidate with the smallest load fraction
//     in-flight/cap; ties go to the earliest in the pool. So a 16-slot box takes two requests for each
//     one an 8-slot box takes, and both fill up together.
//   - With a non-empty key: weighted rendezvous hashing of key and dial address over the candidates.
//     A key stays on one box while that box is a candidate (its prefix cache), keys are spread in
//     proportion to the caps, and when a box leaves (full, unhealthy, removed) only the keys that were
//     on it move, each to its own next choice. The hash is fixed (FNV-1a, then a 64-bit finalizer), not
//     seeded per process, so several front gateways and every reload agree on each key's box.
//   - No candidate: nil, which reverse_proxy answers with 503 "no upstreams available".
//
// Retries: each upstream picked for a request is recorded in the request's variable capacity_tried
// (dial addresses, in order) and is no candidate when Select runs again for that request. So a
// response-based retry (lb_retries, lb_retry_match on the status) goes to another box than the one
// that just refused it; with none left the policy returns nil and reverse_proxy ends with the last
// refusal's status. A request without Caddy's variable table (outside a Caddy server) is not tracked.
//
// An upstream without a cap line is never excluded by this policy (only by Available) and counts as if
// its cap were the largest configured one; the first request that meets it logs a warning, since that
// is usually a mistyped dial address.
//
// The cap is checked when the upstream is chosen: Caddy counts a request against its upstream a moment
// later, when proxying starts, so requests chosen in the same instant can pass it by a few. A box's own
// limits (its gateway's in-flight bound, its engine's queue) stay the strict ones.

package gateway

import (
	"fmt"
	"math"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(new(CapacitySelection))
}

// CapacitySelection selects the upstream with the most spare planned capacity, optionally sticky per
// key.
type CapacitySelection struct {
	// Caps are the upstreams' in-flight caps. At least one is required.
	Caps []UpstreamCap `json:"caps,omitempty"`
	// Hash, if set, names the sticky key: placeholders expanded per request (e.g. "{teamserve_user}").
	Hash string `json:"hash,omitempty"`

	caps   map[string]int
	maxCap int
	logger *zap.Logger
	warned sync.Map // dial address -> struct{}: uncapped upstreams already logged
}

// UpstreamCap is one upstream's cap.
type UpstreamCap struct {
	// Dial is the upstream's dial address, as in reverseproxy.Upstream.Dial (e.g. "10.0.0.1:8443").
	Dial string `json:"dial"`
	// Cap is the most requests in flight this policy sends to it (>= 1).
	Cap int `json:"cap"`
}

// CaddyModule returns the Caddy module information. (Pointer receiver: the policy holds a sync.Map,
// which must not be copied.)
func (*CapacitySelection) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.capacity",
		New: func() caddy.Module { return new(CapacitySelection) },
	}
}

// Provision checks the configuration and indexes the caps by dial address.
func (s *CapacitySelection) Provision(ctx caddy.Context) error {
	s.logger = ctx.Logger()
	if err := s.Validate(); err != nil {
		return err
	}
	s.caps = make(map[string]int, len(s.Caps))
	s.maxCap = 0
	for _, c := range s.Caps {
		s.caps[c.Dial] = c.Cap
		s.maxCap = max(s.maxCap, c.Cap)
	}
	return nil
}

// Validate reports configuration errors (also run by Provision), naming the offending value.
func (s *CapacitySelection) Validate() error {
	if len(s.Caps) == 0 {
		return fmt.Errorf("lb_policy capacity: at least one cap is required (cap <dial address> <max in flight>)")
	}
	seen := make(map[string]bool, len(s.Caps))
	for _, c := range s.Caps {
		if err := checkDial(c.Dial); err != nil {
			return fmt.Errorf("lb_policy capacity: cap %q: %v", c.Dial, err)
		}
		if c.Cap < 1 {
			return fmt.Errorf("lb_policy capacity: cap %s %d: the in-flight cap must be >= 1", c.Dial, c.Cap)
		}
		if seen[c.Dial] {
			return fmt.Errorf("lb_policy capacity: cap %s given twice", c.Dial)
		}
		seen[c.Dial] = true
	}
	if s.Hash != "" && strings.TrimSpace(s.Hash) == "" {
		// Every request would get the same non-empty key, so all of them would go to one box.
		return fmt.Errorf("lb_policy capacity: hash %q is blank; leave it out for least load", s.Hash)
	}
	return nil
}

// checkDial accepts what reverse_proxy puts in Upstream.Dial for a fixed upstream: host:port with a
// port number, or a unix socket. A cap line that can never match an upstream would leave that upstream
// uncapped, so a URL or a missing port is refused here rather than ignored.
func checkDial(dial string) error {
	switch {
	case dial == "":
		return fmt.Errorf("empty dial address")
	case strings.ContainsAny(dial, " \t\r\n"):
		return fmt.Errorf("a dial address has no spaces")
	case strings.Contains(dial, "://"):
		return fmt.Errorf("want the upstream's dial address host:port, not a URL")
	case strings.HasPrefix(dial, "unix/"):
		if len(dial) == len("unix/") {
			return fmt.Errorf("unix socket without a path")
		}
		return nil
	}
	host, port, err := net.SplitHostPort(dial)
	if err != nil {
		return fmt.Errorf("want host:port: %v", err)
	}
	if host == "" {
		return fmt.Errorf("want host:port: missing host")
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("want host:port: port %q is not a number from 1 to 65535", port)
	}
	return nil
}

// Select returns the chosen upstream, or nil when every upstream is unavailable, at its cap, or
// already tried for r (triedVar). The one it returns is added to r's tried list.
func (s *CapacitySelection) Select(pool reverseproxy.UpstreamPool, r *http.Request, _ http.ResponseWriter) *reverseproxy.Upstream {
	tried := triedUpstreams(r)
	i := pick(s, []*reverseproxy.Upstream(pool), s.key(r), tried)
	if i < 0 {
		return nil
	}
	if r != nil {
		caddyhttp.SetVar(r.Context(), triedVar, append(slices.Clip(tried), pool[i].String()))
	}
	return pool[i]
}

// triedVar names the request variable that holds the dial addresses Select already chose for this
// request ([]string): lb_retries calls Select again after a box refused, and that box must not be
// chosen again for the same request.
const triedVar = "capacity_tried"

// triedUpstreams returns r's tried list (nil for none, or without Caddy's variable table).
func triedUpstreams(r *http.Request) []string {
	if r == nil {
		return nil
	}
	tried, _ := caddyhttp.GetVar(r.Context(), triedVar).([]string)
	return tried
}

// key expands the hash placeholders for r; "" without hash.
func (s *CapacitySelection) key(r *http.Request) string {
	if s.Hash == "" || r == nil {
		return ""
	}
	repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok {
		return ""
	}
	return repl.ReplaceAll(s.Hash, "")
}

// upstreamView is what the policy reads from an upstream. *reverseproxy.Upstream has it (String is its
// Dial); the tests use their own type, since an Upstream's request count and health cannot be set from
// outside Caddy's package.
type upstreamView interface {
	Available() bool
	NumRequests() int
	String() string
}

// pick returns the index in pool of the upstream to use, or -1. Upstreams whose dial address is in
// skip (those already tried for this request) are not candidates. Each upstream's count is read
// once, so one decision uses one value even while other requests change it.
func pick[U upstreamView](s *CapacitySelection, pool []U, key string, skip []string) int {
	best := -1
	var bestLoad, bestCap int64 // least-load mode: the best candidate's fraction bestLoad/bestCap
	var bestScore float64       // hash mode
	var keyState uint64
	if key != "" {
		keyState = fnv1a(fnvOffset, key)
	}
	for i, u := range pool {
		if !u.Available() {
			continue
		}
		dial := u.String()
		if slices.Contains(skip, dial) {
			continue
		}
		inFlight := int64(u.NumRequests())
		limit, capped := s.caps[dial]
		if !capped {
			s.warnUncapped(dial)
			limit = s.maxCap
		}
		if capped && inFlight >= int64(limit) {
			continue
		}
		if key == "" {
			// inFlight/limit < bestLoad/bestCap, without division (counts and caps are small).
			if best < 0 || inFlight*bestCap < bestLoad*int64(limit) {
				best, bestLoad, bestCap = i, inFlight, int64(limit)
			}
			continue
		}
		if score := rendezvousScore(keyState, dial, limit); best < 0 || score > bestScore {
			best, bestScore = i, score
		}
	}
	return best
}

// warnUncapped logs, once per dial address and provisioned policy, an upstream without a cap line.
func (s *CapacitySelection) warnUncapped(dial string) {
	if _, already := s.warned.LoadOrStore(dial, struct{}{}); already || s.logger == nil {
		return
	}
	s.logger.Warn("lb_policy capacity: upstream has no cap; it is never excluded and counts as if its cap were the largest configured",
		zap.String("dial", dial), zap.Int("assumed_cap", s.maxCap))
}

const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

// fnv1a continues a 64-bit FNV-1a hash from state over s (hash/fnv's New64a, without its allocation).
func fnv1a(state uint64, s string) uint64 {
	for i := 0; i < len(s); i++ {
		state ^= uint64(s[i])
		state *= fnvPrime
	}
	return state
}

// mix64 is MurmurHash3's 64-bit finalizer. FNV-1a alone leaves its high bits weakly dependent on the
// last bytes, and the last bytes are where two dial addresses of one pool differ; the finalizer makes
// every input bit move about half the output bits, so each key's ranking of the boxes is independent.
func mix64(h uint64) uint64 {
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9fe1a85ec53
	h ^= h >> 33
	return h
}

// rendezvousHash is the stable hash of key and dial (keyState is FNV-1a over the key); a 0 byte
// separates them so that no key/dial pair can be written as another.
func rendezvousHash(keyState uint64, dial string) uint64 {
	return mix64(fnv1a(fnv1a(keyState, "\x00"), dial))
}

// rendezvousScore is the weighted rendezvous score weight / -ln(u), u the hash mapped to (0, 1): the
// upstream with the highest score wins, and each wins a share weight/sum(weights) of the keys. With
// equal weights it orders the upstreams as the plain hash does.
func rendezvousScore(keyState uint64, dial string, weight int) float64 {
	u := (float64(rendezvousHash(keyState, dial)>>11) + 0.5) / (1 << 53)
	return float64(weight) / -math.Log(u)
}

// UnmarshalCaddyfile reads
//
//	lb_policy capacity {
//		cap <dial address> <max in flight>
//		hash <placeholders>
//	}
func (s *CapacitySelection) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the policy name
	if d.NextArg() {
		return d.Errf("lb_policy capacity takes no arguments (caps go in its block), got %q", d.Val())
	}
	seen := make(map[string]bool)
	for d.NextBlock(0) {
		switch d.Val() {
		case "cap":
			args := d.RemainingArgs()
			if len(args) != 2 {
				return d.Errf("cap needs <dial address> <max in flight>, got %d values: %q", len(args), args)
			}
			dial := args[0]
			if err := checkDial(dial); err != nil {
				return d.Errf("cap %q: %v", dial, err)
			}
			n, err := strconv.Atoi(args[1])
			if err != nil || n < 1 {
				return d.Errf("cap %s %q: the in-flight cap must be a whole number >= 1", dial, args[1])
			}
			if seen[dial] {
				return d.Errf("cap %s given twice", dial)
			}
			seen[dial] = true
			s.Caps = append(s.Caps, UpstreamCap{Dial: dial, Cap: n})
		case "hash":
			if s.Hash != "" {
				return d.Err("hash given twice")
			}
			args := d.RemainingArgs()
			if len(args) != 1 || strings.TrimSpace(args[0]) == "" {
				return d.Errf("hash needs one value (placeholders, e.g. {teamserve_user}; quote it if it has spaces), got %q", args)
			}
			s.Hash = args[0]
		default:
			return d.Errf("unknown lb_policy capacity option %q (cap, hash)", d.Val())
		}
	}
	if len(s.Caps) == 0 {
		return d.Err("lb_policy capacity needs at least one cap <dial address> <max in flight>")
	}
	return nil
}

// Interface guards.
var (
	_ reverseproxy.Selector = (*CapacitySelection)(nil)
	_ caddy.Provisioner     = (*CapacitySelection)(nil)
	_ caddy.Validator       = (*CapacitySelection)(nil)
	_ caddyfile.Unmarshaler = (*CapacitySelection)(nil)
)
