package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// fieldsGateway runs request_fields as the role configures it (a salt per person from a header standing
// for the key's user, the front's requests keeping theirs) before reverse_proxy to engine.
func fieldsGateway(t *testing.T, engine *usageEngine) *http.Client {
	client, _ := frontGateway(t, fmt.Sprintf(`http:// {
	bind unix/{socket}
	route {
		request_fields {
			refuse kv_transfer_params vllm_xargs request_id
			refuse_true background
		}
		@salted not header X-User teamserve-front
		request_fields @salted {
			set cache_salt {http.request.header.X-User}
		}
		reverse_proxy %s
	}
}`, engine.Listener.Addr().String()))
	return client
}

func TestRequestFields(t *testing.T) {
	engine := newUsageEngine(t)
	client := fieldsGateway(t, engine)
	cases := []struct {
		id, user, body string
		status         int
		refused        string // the field named in the 400
		salt           any    // the engine's cache_salt (nil: none)
	}{
		{"salted", "alice", `{"model":"m","messages":[]}`, 200, "", "alice"},
		{"client-salt-replaced", "bob", `{"cache_salt":"alice","x":1,"cache_salt":"alice"}`, 200, "", "bob"},
		{"escaped-salt-replaced", "bob", `{"cache_\u0073alt":"alice"}`, 200, "", "bob"},
		{"front-keeps-the-persons", "teamserve-front", `{"cache_salt":"alice"}`, 200, "", "alice"},
		{"team-scope", "", `{"cache_salt":"alice","model":"m"}`, 200, "", nil},
		{"kv", "alice", `{"model":"m","kv_transfer_params":{"do_remote_prefill":true}}`, 400, "kv_transfer_params", nil},
		{"xargs", "alice", `{"vllm_xargs":null}`, 400, "vllm_xargs", nil},
		{"request-id-escaped", "alice", `{"request_\u0069d":"chatcmpl-123"}`, 400, "request_id", nil},
		{"background", "alice", `{"input":"x","background":"yes"}`, 400, "background", nil},
		{"background-repeated", "alice", `{"background":false,"background":1}`, 400, "background", nil},
		{"background-off", "alice", `{"input":"x","background":false}`, 200, "", "alice"},
		{"not-json", "alice", `{"input":`, 200, "", nil},
	}
	for _, c := range cases {
		t.Run(c.id, func(t *testing.T) {
			got := post(context.Background(), client, "", "/v1/responses", c.body, "X-User", c.user)
			if got.status != c.status {
				t.Fatalf("answer %d %q, want %d", got.status, got.body, c.status)
			}
			if c.status != http.StatusOK {
				var e openAIError
				if err := json.Unmarshal([]byte(got.body), &e); err != nil || e.Error.Code != CodeUnsupportedField ||
					e.Error.Param == nil || *e.Error.Param != c.refused || !strings.Contains(e.Error.Message, c.refused) {
					t.Fatalf("refusal %q, want unsupported_field naming %s", got.body, c.refused)
				}
				return
			}
			forwarded := <-engine.bodies
			var members map[string]any
			_ = json.Unmarshal([]byte(forwarded), &members)
			// every member of the name is replaced (the engine keeps the last of repeated names)
			if members["cache_salt"] != c.salt || c.salt != "alice" && strings.Contains(forwarded, "alice") {
				t.Fatalf("engine got %s: cache_salt %v, want %v in every cache_salt member", forwarded, members["cache_salt"], c.salt)
			}
		})
	}
	select {
	case body := <-engine.bodies:
		t.Fatalf("a refused request reached the engine: %s", body)
	default:
	}
}

func TestRequestFieldsCaddyfile(t *testing.T) {
	for _, bad := range []string{"request_fields", "request_fields {\n}", "request_fields {\n refuse\n}",
		"request_fields {\n set a\n}", "request_fields {\n colour red\n}", "request_fields {\n max_size 0\n}"} {
		f := new(RequestFields)
		if err := f.UnmarshalCaddyfile(caddyfile.NewTestDispenser(bad)); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
	f := &RequestFields{Refuse: []string{"cache_salt"}, Set: map[string]string{"cache_salt": "x"}}
	if err := f.Validate(); err == nil {
		t.Error("a member both refused and set was accepted")
	}
}
