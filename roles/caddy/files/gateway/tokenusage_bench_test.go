package gateway

import (
	"fmt"
	"net/http"
	"testing"
)

// discardWriter is a ResponseWriter that drops what is written (the client side of a benchmark).
type discardWriter struct{ header http.Header }

func (d *discardWriter) Header() http.Header         { return d.header }
func (d *discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (d *discardWriter) WriteHeader(int)             {}

// vllmStream returns the events vLLM 0.32 writes for a chat stream of tokens tokens with stream_options
// include_usage and continuous_usage_stats: the role chunk, one chunk per token with its running usage,
// the usage-only chunk and [DONE].
func vllmStream(tokens int) [][]byte {
	const prompt = 42
	head := `data: {"id":"chatcmpl-9f3c2b7a1e4d4c0f","object":"chat.completion.chunk","created":1765150000,"model":"tiny",`
	events := [][]byte{[]byte(head + `"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],` +
		fmt.Sprintf(`"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":0}}`+"\n\n", prompt, prompt))}
	for i := 1; i <= tokens; i++ {
		events = append(events, []byte(head+fmt.Sprintf(`"choices":[{"index":0,"delta":{"content":" word%d"},"logprobs":null,"finish_reason":null}],`+
			`"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}}`+"\n\n", i, prompt, prompt+i, i)))
	}
	events = append(events, []byte(head+fmt.Sprintf(`"choices":[],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}}`+"\n\n",
		prompt, prompt+tokens, tokens)), []byte("data: [DONE]\n\n"))
	return events
}

// The cost of reading a 64-token stream's usage and taking out what the client did not ask for: one
// Write per event, as reverse_proxy passes them on with flush_interval -1.
func BenchmarkTokenUsageStream64(b *testing.B) {
	events := vllmStream(64)
	b.ReportAllocs()
	for b.Loop() {
		w := &discardWriter{header: http.Header{"Content-Type": {"text/event-stream"}}}
		rec := newUsageRecorder(w, usageStrip{final: true, running: true})
		rec.WriteHeader(http.StatusOK)
		for _, e := range events {
			if _, err := rec.Write(e); err != nil {
				b.Fatal(err)
			}
		}
		if err := rec.finish(); err != nil {
			b.Fatal(err)
		}
		if c, ok := rec.counts(); !ok || c.completion != 64 {
			b.Fatalf("counted %+v %v", c, ok)
		}
	}
}
