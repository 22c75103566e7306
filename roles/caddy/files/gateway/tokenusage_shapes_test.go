package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// engineBool reads every recorded value as pydantic did: the bools the engine runs on are the ones the
// gateway acts on.
func TestEngineBoolMatchesPydantic(t *testing.T) {
	if len(pydanticOracle) < 40 {
		t.Fatalf("the oracle has %d values", len(pydanticOracle))
	}
	for value, want := range pydanticOracle {
		got, ok := engineBool([]byte(value))
		if ok != (want != nil) || ok && got != *want {
			t.Errorf("engineBool(%s) = %v, %v; pydantic: %v", value, got, ok, describe(want))
		}
	}
}

func describe(b *bool) string {
	if b == nil {
		return "refused (422)"
	}
	if *b {
		return "true"
	}
	return "false"
}

// Every body the engine streams for is asked for its usage and counted, whatever spelling of "stream"
// it uses, and the client sees the usage only where it asked for it in a spelling the engine accepts;
// an answer of any size counts; a "usage" inside a string counts nothing.
func TestTokenUsageCountsEveryBodyShape(t *testing.T) {
	engine := newUsageEngine(t)
	client, logPath := usageGateway(t, engine)
	cases := []struct {
		id, path, body string
		stream         bool // the engine streamed
		clientUsages   int  // chunks with a "usage" the client gets
		prompt, compl  float64
	}{
		{"one", "/v1/chat/completions", `{"stream":1,"messages":[]}`, true, 0, doublePrompt, doubleCompletion},
		{"string-true", "/v1/chat/completions", `{"stream":"true"}`, true, 0, doublePrompt, doubleCompletion},
		{"upper", "/v1/completions", `{"stream":"TRUE","prompt":"x"}`, true, 0, doublePrompt, doubleCompletion},
		{"yes", "/v1/completions", `{"stream":"yes"}`, true, 0, doublePrompt, doubleCompletion},
		{"on", "/v1/completions", `{"stream":"on"}`, true, 0, doublePrompt, doubleCompletion},
		{"float", "/v1/chat/completions", `{"stream":1.0}`, true, 0, doublePrompt, doubleCompletion},
		{"escaped-value", "/v1/chat/completions", `{"stream":"\u0074rue"}`, true, 0, doublePrompt, doubleCompletion},
		{"escaped-name", "/v1/chat/completions", `{"\u0073tream":1}`, true, 0, doublePrompt, doubleCompletion},
		{"repeated", "/v1/chat/completions", `{"stream":false,"stream":"1"}`, true, 0, doublePrompt, doubleCompletion},
		{"usage-asked-as-1", "/v1/chat/completions", `{"stream":1,"stream_options":{"include_usage":"1"}}`, true, 1, doublePrompt, doubleCompletion},
		{"usage-declined", "/v1/chat/completions", `{"stream":"y","stream_options":{"include_usage":0}}`, true, 0, doublePrompt, doubleCompletion},
		{"both-asked", "/v1/completions", `{"stream":1,"stream_options":{"include_usage":1,"continuous_usage_stats":"on"}}`, true, 3, doublePrompt, doubleCompletion},
		{"zero", "/v1/chat/completions", `{"stream":0}`, false, 0, doublePrompt, doubleCompletion},
		{"string-false", "/v1/completions", `{"stream":"false"}`, false, 0, doublePrompt, doubleCompletion},
		{"refused-spelling", "/v1/completions", `{"stream":" true"}`, false, 0, doublePrompt, doubleCompletion},
		{"responses-on", "/v1/responses", `{"input":"x","stream":"on"}`, true, 1, 11, 5},
		{"big", "/v1/big", `{"n":2,"logprobs":true}`, false, 0, doublePrompt, doubleCompletion},
		{"big-usage-first", "/v1/big-usage-first", `{"prompt_logprobs":5}`, false, 0, doublePrompt, doubleCompletion},
	}
	for _, c := range cases {
		t.Run(c.id, func(t *testing.T) {
			got := post(context.Background(), client, "", c.path, c.body, "X-Request-Id", c.id)
			if got.status != http.StatusOK {
				t.Fatalf("answer %d %q", got.status, got.body)
			}
			forwarded := engineRequest([]byte(<-engine.bodies))
			if c.stream && (!forwarded.StreamOptions.IncludeUsage || !forwarded.StreamOptions.Continuous) {
				t.Fatalf("the engine streamed without being asked for the usage: %+v", forwarded)
			}
			isStream := strings.HasPrefix(got.body, "data:") || strings.HasPrefix(got.body, "event:")
			if isStream != c.stream {
				t.Fatalf("streamed %v, want %v: %.200q", isStream, c.stream, got.body)
			}
			if c.stream {
				if n := strings.Count(got.body, `"usage"`); n != c.clientUsages {
					t.Fatalf("%d chunks with a usage at the client, want %d: %q", n, c.clientUsages, got.body)
				}
			} else if len(got.body) < 100 && c.path != "/v1/big" && !strings.Contains(got.body, `"usage"`) {
				t.Fatalf("the client's answer lost its usage: %q", got.body)
			}
			prompt, completion := tokensLogged(accessLogEntries(t, logPath, c.id))
			if prompt != c.prompt || completion != c.compl {
				t.Fatalf("logged prompt %v completion %v, want %v and %v", prompt, completion, c.prompt, c.compl)
			}
		})
	}
}

// The usage scanner, fed in pieces of any size, finds what encoding/json finds in the whole answer: the
// last top-level "usage" (exact name after unescaping), read as readUsage reads it.
func FuzzUsageScanner(f *testing.F) {
	for _, seed := range []string{
		`{"id":"c","choices":[{"message":{"content":"\"usage\":{}"}}],"usage":{"prompt_tokens":3,"completion_tokens":4}}`,
		`{"usage":{"input_tokens":1,"output_tokens":2},"x":[{"usage":{"prompt_tokens":9}}]}`,
		`{"usage":null,"\u0075sage":{"prompt_tokens":0}}`,
		`{"usage":{"prompt_tokens":1},"usage":"x"}`,
		`[{"usage":{"prompt_tokens":1}}]`,
		`{"a":"\\","usage" : { "prompt_tokens" : 5 , "completion_tokens":null } }`,
	} {
		f.Add([]byte(seed), uint8(3))
	}
	f.Fuzz(func(t *testing.T, doc []byte, piece uint8) {
		var s usageScanner
		for rest := doc; len(rest) > 0; {
			n := min(int(piece)+1, len(rest))
			s.Write(rest[:n])
			rest = rest[n:]
		}
		var whole map[string]json.RawMessage
		if !json.Valid(doc) || json.Unmarshal(doc, &whole) != nil {
			return // only: no panic
		}
		want, wantFound := readUsage(bytes.TrimSpace(whole["usage"]))
		if s.found != wantFound || s.usage != want {
			t.Fatalf("scanner %+v %v, encoding/json %+v %v in %q", s.usage, s.found, want, wantFound, doc)
		}
	})
}

// The stream reader, fed an answer in pieces of any size, sends on every byte when it strips nothing,
// and counts the same as when the whole answer comes in one write.
func FuzzUsageEvents(f *testing.F) {
	for _, seed := range []string{
		string(bytes.Join(vllmStream(3), nil)),
		"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":11,\"output_tokens\":5}}}\n\n",
		"data: {\"choices\":[{\"index\":1}],\r\ndata: \"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1}}\r\n\r\n: keep-alive\n\ndata: [DONE]\n\n",
		"data:{\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":7}}\n\ndata: {\"choices\"",
	} {
		f.Add([]byte(seed), uint8(5), false)
	}
	f.Fuzz(func(t *testing.T, stream []byte, piece uint8, strip bool) {
		read := func(size int, strip usageStrip) ([]byte, tokenCounts, bool) {
			var sent bytes.Buffer
			w := &bufferWriter{header: http.Header{"Content-Type": {"text/event-stream"}}, buf: &sent}
			rec := newUsageRecorder(w, strip)
			rec.WriteHeader(http.StatusOK)
			for rest := stream; len(rest) > 0; {
				n := min(size, len(rest))
				if _, err := rec.Write(rest[:n]); err != nil {
					t.Fatal(err)
				}
				rest = rest[n:]
			}
			if err := rec.finish(); err != nil {
				t.Fatal(err)
			}
			counts, found := rec.counts()
			return sent.Bytes(), counts, found
		}
		how := usageStrip{}
		if strip {
			how = usageStrip{final: true, running: true}
		}
		sent, counts, found := read(int(piece)+1, how)
		_, wholeCounts, wholeFound := read(len(stream)+1, how)
		if counts != wholeCounts || found != wholeFound {
			t.Fatalf("in pieces of %d: %+v %v; whole: %+v %v", int(piece)+1, counts, found, wholeCounts, wholeFound)
		}
		if !strip && !bytes.Equal(sent, stream) {
			t.Fatalf("sent on %q, want every byte of %q", sent, stream)
		}
	})
}

// bufferWriter is a ResponseWriter that keeps what is written.
type bufferWriter struct {
	header http.Header
	buf    *bytes.Buffer
}

func (b *bufferWriter) Header() http.Header         { return b.header }
func (b *bufferWriter) Write(p []byte) (int, error) { return b.buf.Write(p) }
func (b *bufferWriter) WriteHeader(int)             {}
