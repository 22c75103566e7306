// Package gateway holds the teamserve gateway's own Caddy modules, for what no Caddy module known to
// the project does:
//
//   - api_key_map (keymap.go, http.handlers.api_key_map): bearer key -> placeholders (user name,
//     limits), from the keys' SHA-256 only, in one hash-table lookup per request whatever the number
//     of keys;
//   - inflight_limit (inflight.go, http.handlers.inflight_limit): at most N requests in flight per
//     key, 429 beyond;
//   - request_model (requestmodel.go, http.handlers.request_model): the JSON body's top-level "model"
//     string -> a placeholder, for matchers (a front gateway routing each model to its boxes), the
//     body forwarded unchanged;
//   - lb_policy capacity (capacity.go, http.reverse_proxy.selection_policies.capacity): reverse_proxy
//     upstream selection by each upstream's share of its own in-flight cap, never past the cap,
//     optionally sticky per key (weighted rendezvous hashing).
package gateway
