// Package gateway holds the teamserve gateway's own Caddy HTTP handlers, for what no Caddy module
// known to the project does:
//
//   - api_key_map (keymap.go): bearer key -> placeholders (user name, limits), from the keys' SHA-256
//     only, in one hash-table lookup per request whatever the number of keys;
//   - inflight_limit (inflight.go): at most N requests in flight per key, 429 beyond.
package gateway
