// Package gateway holds the teamserve gateway's own Caddy modules, for what no Caddy module known to
// the project does:
//
//   - api_key_map (keymap.go, http.handlers.api_key_map): bearer key -> placeholders (user name,
//     limits), from the keys' SHA-256 only, in one hash-table lookup per request whatever the number
//     of keys;
//   - inflight_limit (inflight.go, http.handlers.inflight_limit): at most N in flight per key,
//     counted in requests or, with `cost`, in engine sequences; 429 beyond, 400 for one request
//     larger than N; the key's in-flight sum as placeholders for the handlers after it;
//   - request_model (requestmodel.go, http.handlers.request_model): the JSON body's top-level "model"
//     string -> a placeholder, for matchers (a front gateway routing each model to its boxes), the
//     body forwarded unchanged;
//   - request_cost (requestcost.go, http.handlers.request_cost): the engine sequences a request asks
//     for (n x prompts, as vLLM counts them) -> a placeholder for inflight_limit's `cost`; 400 for an
//     n or a prompt list the engine would refuse; the body forwarded unchanged;
//   - request_priority (requestpriority.go, http.handlers.request_priority): the JSON body's
//     "priority" (vLLM --scheduling-policy priority) set from the user's in-flight sequences and fair
//     share, never the client's;
//   - request_fields (requestfields.go, http.handlers.request_fields): body members that steer the
//     engine refused naming the member (some only when true, read as the engine reads a bool); members
//     the gateway owns (cache_salt) written by it;
//   - token_usage (tokenusage.go, http.handlers.token_usage): each answer's prompt and completion
//     tokens, as the engine counted them, into its access-log entry, read as the answer passes
//     (usagescan.go: any size); a stream is asked for its usage and the usage chunk the client did not
//     ask for is kept from it;
//   - lb_policy capacity (capacity.go, http.reverse_proxy.selection_policies.capacity): reverse_proxy
//     upstream selection by each upstream's share of its own in-flight cap, never past the cap,
//     optionally sticky per key (weighted rendezvous hashing), never the same upstream twice for one
//     request (lb_retries after a box refused it).
//
// request_model, request_cost, request_fields, request_priority and token_usage read a request's body once
// between them (body.go)
// and read its JSON as the engine does (jsondoc.go).
package gateway
