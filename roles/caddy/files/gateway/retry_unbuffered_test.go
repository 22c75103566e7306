//go:build !race

package gateway

import (
	"context"
	"net/http"
	"testing"
)

// This case runs without the race detector (Makefile's go-test runs it in a second pass): with no
// request_buffers, Caddy's retry reads the client's body while the first attempt's transport goroutine
// may still be reading it. The detector reports that race inside reverse_proxy, which is one more
// reason the template buffers.

// Why the template sets request_buffers: request_model holds the body in its own reader, which
// reverse_proxy cannot rewind, so without Caddy's own buffer the retry does not carry the body.
func TestFrontRetryWithoutRequestBuffersLosesTheBody(t *testing.T) {
	first, second := newBoxDouble(t, http.StatusServiceUnavailable), newBoxDouble(t, http.StatusOK)
	client, _ := frontGateway(t, frontCaddyfile(false, first, second))
	body := bigChat()
	got := post(context.Background(), client, "", "/v1/chat/completions", body)
	if bodies := second.got(); got.status == http.StatusOK && len(bodies) == 1 && bodies[0] == body {
		t.Fatal("the retry carried the whole body without request_buffers: the template's buffer may be dropped")
	}
}
