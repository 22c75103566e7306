package gateway

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/map" // the map directive, as in the standard build
)

// The idiom the role's Caddyfile uses on a front gateway to give each box its own key: a map from the
// upstream Caddy picked ({upstream_hostport}, known only once reverse_proxy has chosen) to that box's
// Authorization value, read by header_up. Map outputs are evaluated only when read (Caddy's map
// directive docs, caddyserver.com/docs/caddyfile/directives/map), so the value follows each pick,
// retries to another box included.
func TestFrontSendsEachBoxItsOwnKey(t *testing.T) {
	var mu sync.Mutex
	seen := map[string][]string{} // box -> Authorization values it got
	box := func(name string, status int) *httptest.Server {
		s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			seen[name] = append(seen[name], r.Header.Get("Authorization"))
			mu.Unlock()
			w.WriteHeader(status)
		}))
		t.Cleanup(s.Close)
		return s
	}
	one, two := box("one", http.StatusServiceUnavailable), box("two", http.StatusOK)
	addr := func(s *httptest.Server) string { return s.Listener.Addr().String() }
	client, _ := frontGateway(t, fmt.Sprintf(`http:// {
	bind unix/{socket}
	route {
		map {upstream_hostport} {teamserve_box_auth} {
			%s "Bearer key-one"
			%s "Bearer key-two"
		}
		reverse_proxy %s %s {
			lb_policy round_robin
			lb_retries 1
			request_buffers 1024
			lb_retry_match {
				expression `+"`{rp.status_code} == 503`"+`
			}
			header_up Authorization {teamserve_box_auth}
		}
	}
}`, addr(one), addr(two), addr(one), addr(two)))
	for i := 0; i < 4; i++ { // box one answers 503 and the request is retried on box two
		if got := post(context.Background(), client, "user-key", "/v1/chat/completions", `{}`); got.status != http.StatusOK {
			t.Fatalf("answer %d %q", got.status, got.body)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	own := func(values []string, key string) bool {
		return strings.Count(strings.Join(values, ","), "Bearer "+key) == len(values)
	}
	if len(seen["one"]) == 0 || len(seen["two"]) != 4 || !own(seen["one"], "key-one") || !own(seen["two"], "key-two") {
		t.Fatalf("keys the boxes got: %v, want each its own, retries included", seen)
	}
}
