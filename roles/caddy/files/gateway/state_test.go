package gateway

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"

	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/fileserver" // the `file` matcher
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/headers"
)

// The caddy role drains and puts a gateway in maintenance by writing flag files (tasks/state.yml), which
// the Caddyfile's `file` matchers look for on each request, with the Retry-After seconds read from the
// file by the {file.*} placeholder. This checks that Caddy (the pinned version) does so without a reload,
// with the same directives as templates/Caddyfile.j2.
func TestStateFlagFilesTakeEffectWithoutAReload(t *testing.T) {
	upstream := newHoldingBackend(t)
	close(upstream.release)
	state := t.TempDir()
	client := caddyClient(t, fmt.Sprintf(`http:// {
	bind unix/{socket}
	route {
		@health path /health
		handle @health {
			@draining file {
				root %[1]s
				try_files /draining
			}
			handle @draining {
				header Retry-After {file.%[1]s/draining}
				respond "maintenance" 503
			}
			handle {
				reverse_proxy %[2]s
			}
		}
		@maintenance {
			path /v1/*
			file {
				root %[1]s
				try_files /maintenance
			}
		}
		handle @maintenance {
			header Retry-After {file.%[1]s/maintenance}
			respond "maintenance" 503
		}
		reverse_proxy %[2]s
	}
}`, state, upstream.Listener.Addr().String()))
	get := func(path string) (int, string) {
		t.Helper()
		resp, err := client.Get("http://gateway" + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, resp.Header.Get("Retry-After")
	}
	write := func(name, content string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(state, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want := func(step, path string, status int, retryAfter string) {
		t.Helper()
		if gotStatus, gotRetry := get(path); gotStatus != status || gotRetry != retryAfter {
			t.Fatalf("%s: GET %s = %d (Retry-After %q), want %d (%q)", step, path, gotStatus, gotRetry, status, retryAfter)
		}
	}
	want("serving", "/health", 200, "")
	want("serving", "/v1/models", 200, "")

	write("draining", "42\n")
	want("draining", "/health", 503, "42")
	want("draining", "/v1/models", 200, "")

	write("maintenance", "42\n")
	want("maintenance", "/health", 503, "42")
	want("maintenance", "/v1/models", 503, "42")

	for _, name := range []string{"maintenance", "draining"} {
		if err := os.Remove(filepath.Join(state, name)); err != nil {
			t.Fatal(err)
		}
	}
	want("serving again", "/health", 200, "")
	want("serving again", "/v1/models", 200, "")
}
