package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// boxDouble stands in for a box's gateway behind a front: it answers every request with the status
// in status (200 with its own address as the body, else an empty error) and sends the request body
// it received on bodies. Status hangUp drops the connection instead (a box that fails mid-request).
type boxDouble struct {
	*httptest.Server
	status atomic.Int32
	bodies chan string
}

func newBoxDouble(t *testing.T, status int) *boxDouble {
	b := &boxDouble{bodies: make(chan string, 64)}
	b.status.Store(int32(status))
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		b.bodies <- string(body)
		status := int(b.status.Load())
		if status == hangUp {
			panic(http.ErrAbortHandler)
		}
		if status != http.StatusOK {
			w.WriteHeader(status)
			return
		}
		_, _ = io.WriteString(w, b.dial())
	}))
	t.Cleanup(b.Close)
	return b
}

const hangUp = -1

func (b *boxDouble) dial() string { return b.Listener.Addr().String() }

// got returns the bodies the box has received so far.
func (b *boxDouble) got() []string {
	var out []string
	for {
		select {
		case body := <-b.bodies:
			out = append(out, body)
		default:
			return out
		}
	}
}

// frontCaddyfile is a front's API pool as roles/caddy/templates/Caddyfile.j2 writes it (front_pool,
// front_proxy, handle_errors 429 and 503), over boxes, with request_model holding the body as a
// front with per-model pools does. buffers false leaves out request_buffers.
func frontCaddyfile(buffers bool, boxes ...*boxDouble) string {
	var dials, caps []string
	for _, b := range boxes {
		dials = append(dials, b.dial())
		caps = append(caps, fmt.Sprintf("cap %s 4", b.dial()))
	}
	requestBuffers := ""
	if buffers {
		requestBuffers = "request_buffers 1000001"
	}
	return fmt.Sprintf(`http:// {
	bind unix/{socket}
	request_body {
		max_size 1000000
	}
	route {
		request_model {teamserve_model} {
			max_size 1000000
		}
		reverse_proxy %[1]s {
			lb_policy capacity {
				%[2]s
			}
			fail_duration 1m
			max_fails 1
			unhealthy_status 502
			lb_retries %[3]d
			lb_retry_match {
				expression `+"`{rp.status_code} in [429, 503] && {rp.is_transport_error} != true`"+`
			}
			%[4]s
			transport http {
				keepalive off
			}
			@box_full status 503
			handle_response @box_full {
				error "engine queue full" 503
			}
			@box_busy status 429
			handle_response @box_busy {
				error "engine queue full" 503
			}
		}
	}
	handle_errors 429 {
		@box_busy vars {rp.status_code} 429
		handle @box_busy {
			header Retry-After 5
			respond "server_full" 503
		}
		handle {
			respond "rate_limit_exceeded" 429
		}
	}
	handle_errors 503 {
		header Retry-After 5
		respond "server_full" 503
	}
}`, strings.Join(dials, " "), strings.Join(caps, "\n\t\t\t\t"), len(boxes)-1, requestBuffers)
}

// frontGateway runs caddyfileText in an in-process Caddy whose admin API listens on a unix socket; it
// returns a client for the site and one for the admin API.
func frontGateway(t *testing.T, caddyfileText string) (site, admin *http.Client) {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("XDG_DATA_HOME", dir)
	t.Setenv("XDG_CONFIG_HOME", dir)
	socket, adminSocket := filepath.Join(dir, "s.sock"), filepath.Join(dir, "admin.sock")
	text := "{\n\tadmin unix/" + adminSocket + "\n\tpersist_config off\n\tstorage file_system " + dir + "\n}\n" +
		strings.ReplaceAll(caddyfileText, "{socket}", socket)
	config, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(text), nil)
	if err != nil {
		t.Fatalf("adapt: %v", err)
	}
	if err := caddy.Load(config, true); err != nil {
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	client := func(path string) *http.Client {
		return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
			DisableKeepAlives: true,
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, "unix", path)
			}}}
	}
	return client(socket), client(adminSocket)
}

// fails returns reverse_proxy's passive failure count of each of boxes, from the admin API (a box
// with fails >= max_fails is out of the pool for fail_duration).
func fails(t *testing.T, admin *http.Client, boxes ...*boxDouble) []int {
	t.Helper()
	resp, err := admin.Get("http://localhost/reverse_proxy/upstreams")
	if err != nil {
		t.Fatalf("admin: %v", err)
	}
	defer resp.Body.Close()
	var upstreams []struct {
		Address string `json:"address"`
		Fails   int    `json:"fails"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&upstreams); err != nil {
		t.Fatalf("admin answer: %v", err)
	}
	out := make([]int, len(boxes))
	for i, b := range boxes {
		out[i] = -1
		for _, u := range upstreams {
			if u.Address == b.dial() {
				out[i] = u.Fails
			}
		}
	}
	return out
}

// bigChat is a chat request of about 300 KB, larger than any one read or write buffer on the way.
func bigChat() string {
	return `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("0123456789", 30000) + `"}]}`
}

// A box's 503 or 429 sends the same POST to the other box with its whole body; the client gets the
// other box's 200; the refusing box is not taken out of the pool (its next request still reaches it).
func TestFrontRetriesARefusalOnAnotherBox(t *testing.T) {
	for _, refusal := range []int{http.StatusServiceUnavailable, http.StatusTooManyRequests} {
		t.Run(fmt.Sprint(refusal), func(t *testing.T) {
			first, second := newBoxDouble(t, refusal), newBoxDouble(t, http.StatusOK)
			client, admin := frontGateway(t, frontCaddyfile(true, first, second))
			body := bigChat()
			got := post(context.Background(), client, "", "/v1/chat/completions", body)
			if got.status != http.StatusOK || got.body != second.dial() {
				t.Fatalf("answer %d %.200q, want 200 from the second box", got.status, got.body)
			}
			// Least load, all idle: the first box is asked first, once.
			if firstGot, secondGot := first.got(), second.got(); len(firstGot) != 1 || len(secondGot) != 1 ||
				firstGot[0] != body || secondGot[0] != body {
				t.Fatalf("bodies: first box %d (%v), second box %d (%v), want one whole body each",
					len(firstGot), lengths(firstGot), len(secondGot), lengths(secondGot))
			}
			if f := fails(t, admin, first, second); f[0] != 0 || f[1] != 0 {
				t.Fatalf("passive failures %v, want none", f)
			}
			first.status.Store(http.StatusOK)
			if got := post(context.Background(), client, "", "/v1/chat/completions", body); got.body != first.dial() {
				t.Fatalf("after its refusal the first box got no request (answer %d %.200q): taken out", got.status, got.body)
			}
		})
	}
}

// Every box refuses: each is asked once, the client gets the front's own 503 server_full with
// Retry-After (a 429 too: the fleet is full, not the user's limit), and no box is taken out.
func TestFrontEveryBoxRefusing(t *testing.T) {
	for _, refusals := range [][]int{{503, 503, 503}, {429, 429}, {503, 429}, {429, 503}} {
		t.Run(fmt.Sprint(refusals), func(t *testing.T) {
			var boxes []*boxDouble
			for _, status := range refusals {
				boxes = append(boxes, newBoxDouble(t, status))
			}
			client, admin := frontGateway(t, frontCaddyfile(true, boxes...))
			req, _ := http.NewRequest(http.MethodPost, "http://gateway/v1/chat/completions", strings.NewReader(bigChat()))
			req.Header.Set("Content-Type", "application/json")
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			answer, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusServiceUnavailable || string(answer) != "server_full" ||
				resp.Header.Get("Retry-After") != "5" {
				t.Fatalf("answer %d %q Retry-After %q, want 503 server_full with Retry-After",
					resp.StatusCode, answer, resp.Header.Get("Retry-After"))
			}
			for i, b := range boxes {
				if n := len(b.got()); n != 1 {
					t.Errorf("box %d was asked %d times, want once", i, n)
				}
			}
			for i, f := range fails(t, admin, boxes...) {
				if f != 0 {
					t.Errorf("box %d has %d passive failures, want none", i, f)
				}
			}
		})
	}
}

// A box's 502 (its engine down) still takes it out, and is not retried.
func TestFrontBadGatewayStillEjects(t *testing.T) {
	first, second := newBoxDouble(t, http.StatusBadGateway), newBoxDouble(t, http.StatusOK)
	client, admin := frontGateway(t, frontCaddyfile(true, first, second))
	if got := post(context.Background(), client, "", "/v1/chat/completions", bigChat()); got.status != http.StatusBadGateway {
		t.Fatalf("answer %d, want the box's 502", got.status)
	}
	if f := fails(t, admin, first, second); f[0] != 1 || f[1] != 0 {
		t.Fatalf("passive failures %v, want [1 0]", f)
	}
	if got := post(context.Background(), client, "", "/v1/chat/completions", "{}"); got.body != second.dial() {
		t.Fatalf("answer %d %q, want the second box while the first is out", got.status, got.body)
	}
}

// A connection that fails after the request was sent is not retried, even after an earlier box's 503
// left {rp.status_code} at 503: the box may have run the request (and a hung one already took the
// client's read_timeout).
func TestFrontTransportErrorAfterARefusalIsNotRetried(t *testing.T) {
	first, second, third := newBoxDouble(t, http.StatusServiceUnavailable), newBoxDouble(t, hangUp), newBoxDouble(t, http.StatusOK)
	client, _ := frontGateway(t, frontCaddyfile(true, first, second, third))
	if got := post(context.Background(), client, "", "/v1/chat/completions", "{}"); got.status != http.StatusBadGateway {
		t.Fatalf("answer %d %q, want 502", got.status, got.body)
	}
	if n := [3]int{len(first.got()), len(second.got()), len(third.got())}; n != [3]int{1, 1, 0} {
		t.Fatalf("requests per box %v, want [1 1 0]", n)
	}
}

func lengths(bodies []string) []int {
	out := make([]int, len(bodies))
	for i, b := range bodies {
		out[i] = len(b)
	}
	return out
}

// Select records each upstream it picks in the request's variables and does not pick it again for
// that request while another candidate is left; with none left, nil. Requests are independent.
func TestCapacitySkipsUpstreamsTriedForTheRequest(t *testing.T) {
	dials := []string{"10.0.0.1:8443", "10.0.0.2:8443", "10.0.0.3:8443"}
	var pool reverseproxy.UpstreamPool
	for _, d := range dials {
		pool = append(pool, &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: d})
	}
	for _, hash := range []string{"", "{user}"} {
		s := newCapacity(t, hash, dials[0], 8, dials[1], 16, dials[2], 8)
		newRequest := func() *http.Request {
			return caddyhttp.PrepareRequest(withKey("alice"), caddy.NewReplacer(), nil, &caddyhttp.Server{})
		}
		r := newRequest()
		var order []string
		for range dials {
			u := s.Select(pool, r, nil)
			if u == nil {
				t.Fatalf("hash %q: nil after %v", hash, order)
			}
			order = append(order, u.Dial)
		}
		if got := s.Select(pool, r, nil); got != nil {
			t.Fatalf("hash %q: every upstream tried, got %s, want nil", hash, got.Dial)
		}
		seen := map[string]bool{}
		for _, d := range order {
			seen[d] = true
		}
		if len(seen) != len(dials) {
			t.Fatalf("hash %q: picks %v repeat an upstream", hash, order)
		}
		// The tried list is the request's: a new request starts from the same first choice.
		if got := s.Select(pool, newRequest(), nil); got == nil || got.Dial != order[0] {
			t.Fatalf("hash %q: a new request got %v, want %s", hash, got, order[0])
		}
		if tried := caddyhttp.GetVar(r.Context(), triedVar); fmt.Sprint(tried) != fmt.Sprint(order) {
			t.Fatalf("hash %q: %s = %v, want %v", hash, triedVar, tried, order)
		}
	}
	// Without least load's tie-break: the first pick skipped, the next by load is the second box.
	plain := newCapacity(t, "", dials[0], 8, dials[1], 16, dials[2], 8)
	if i := pick(plain, fakes(dials...), "", []string{dials[0]}); i != 1 {
		t.Fatalf("skipping %s: got %d, want 1", dials[0], i)
	}
	// An unavailable or full upstream is still no candidate, tried or not.
	pool2 := fakes(dials...)
	pool2[1].down = true
	pool2[2].inFlight = 8
	if i := pick(plain, pool2, "", []string{dials[0]}); i != -1 {
		t.Fatalf("the only candidate tried: got %d, want -1", i)
	}
	// A request without Caddy's variables (outside a server) is not tracked.
	bare := withKey("alice")
	if a, b := plain.Select(pool, bare, nil), plain.Select(pool, bare, nil); a != pool[0] || b != pool[0] {
		t.Fatalf("untracked request: %v then %v, want the first twice", a, b)
	}
}
