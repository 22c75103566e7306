// Reading an answer's "usage" as it passes, without holding the answer: an answer of any size (n
// choices with logprobs run to megabytes) is counted with a few hundred bytes of state.

package gateway

import (
	"bytes"
	"encoding/json"
	"strconv"
)

// maxUsageValue is the most bytes of a top-level "usage" value kept to read it: vLLM's is about 150
// bytes (the counts and prompt_tokens_details); a larger one is not a usage the engine wrote.
const maxUsageValue = 64 << 10

// usageScanner finds the top-level "usage" member of a JSON object fed to it in pieces of any size (a
// JSON answer as reverse_proxy writes it). It tracks strings and nesting only, keeps nothing but the
// current top-level member name and the bytes of a "usage" value, and reads each such value when it
// ends; of repeated members the last counts, as in the Python dict the engine serialised. A value that
// was whole counts even if the answer is cut after it: the engine generated those tokens.
type usageScanner struct {
	depth              int
	inString, escaped  bool
	expectName, inName bool // at depth 1: the next string is a member name; reading one
	name               []byte
	nameLong           bool
	capture            bool // reading the value of a top-level "usage"
	value              []byte
	valueLong          bool
	started, broken    bool

	usage tokenCounts
	found bool
}

// maxNameBytes bounds the member name kept: "usage" written with every letter escaped is 30 bytes.
const maxNameBytes = 64

// Write reads p as the next bytes of the answer; it never fails.
func (s *usageScanner) Write(p []byte) {
	for _, c := range p {
		if s.broken {
			return
		}
		if s.inString {
			if s.capture {
				s.keep(c)
			}
			switch {
			case s.escaped:
				s.escaped = false
			case c == '\\':
				s.escaped = true
			case c == '"':
				s.inString = false
				if s.inName {
					s.inName = false
					continue
				}
			}
			if s.inName {
				if len(s.name) < maxNameBytes {
					s.name = append(s.name, c)
				} else {
					s.nameLong = true
				}
			}
			continue
		}
		switch c {
		case '"':
			s.inString = true
			if s.depth == 1 && s.expectName {
				s.inName, s.name, s.nameLong = true, s.name[:0], false
			}
		case '{', '[':
			if s.depth == 0 {
				if c != '{' || s.started {
					s.broken = true
					return
				}
				s.started, s.expectName = true, true
			}
			s.depth++
		case '}', ']':
			if s.depth == 1 && s.capture {
				s.end()
			}
			s.depth--
			if s.depth < 0 {
				s.broken = true
				return
			}
		case ':':
			if s.depth == 1 && s.expectName {
				s.expectName = false
				if s.isUsage() {
					s.capture, s.value, s.valueLong = true, s.value[:0], false
					continue
				}
			}
		case ',':
			if s.depth == 1 {
				if s.capture {
					s.end()
				}
				s.expectName = true
			}
		}
		if s.capture {
			s.keep(c)
		}
	}
}

func (s *usageScanner) keep(c byte) {
	if len(s.value) < maxUsageValue {
		s.value = append(s.value, c)
	} else {
		s.valueLong = true
	}
}

// isUsage reports whether the member name just read is "usage" (escapes decoded).
func (s *usageScanner) isUsage() bool {
	if s.nameLong {
		return false
	}
	if string(s.name) == "usage" {
		return true
	}
	if bytes.IndexByte(s.name, '\\') < 0 {
		return false
	}
	var decoded string
	quoted := append(append([]byte{'"'}, s.name...), '"')
	return json.Unmarshal(quoted, &decoded) == nil && decoded == "usage"
}

// end reads the "usage" value just closed: the last one decides.
func (s *usageScanner) end() {
	s.capture = false
	s.usage, s.found = tokenCounts{}, false
	if !s.valueLong {
		s.usage, s.found = readUsage(bytes.Trim(s.value, " \t\r\n"))
	}
}

// readUsage reads a "usage" value, in either naming: {"prompt_tokens", "completion_tokens"} (chat,
// completions, embeddings, which have no completion_tokens) or {"input_tokens", "output_tokens"}
// (responses). Names are matched exactly, escapes decoded, the last of repeated names counts; a count
// must be a JSON integer >= 0. false for anything else (null, a usage without prompt tokens).
func readUsage(value []byte) (tokenCounts, bool) {
	if len(value) == 0 || value[0] != '{' || !json.Valid(value) {
		return tokenCounts{}, false
	}
	var prompt, completion, input, output []byte
	members(value, func(m member) {
		v := value[m.start:m.end]
		switch {
		case isName(m.name, "prompt_tokens"):
			prompt = v
		case isName(m.name, "completion_tokens"):
			completion = v
		case isName(m.name, "input_tokens"):
			input = v
		case isName(m.name, "output_tokens"):
			output = v
		}
	})
	if isNull(prompt) {
		prompt, completion = input, output
	}
	p, ok := tokenCount(prompt)
	if !ok {
		return tokenCounts{}, false
	}
	c := tokenCounts{prompt: p}
	if !isNull(completion) {
		if c.completion, ok = tokenCount(completion); !ok {
			return tokenCounts{}, false
		}
	}
	return c, true
}

func isNull(v []byte) bool { return v == nil || string(v) == "null" }

// tokenCount reads a JSON integer >= 0 that fits an int.
func tokenCount(v []byte) (int, bool) {
	if len(v) == 0 || v[0] < '0' || v[0] > '9' {
		return 0, false
	}
	n, err := strconv.Atoi(string(v))
	return n, err == nil
}
