// The request body as the engine reads it, for request_cost (which counts what it asks for) and
// request_priority (which rewrites one member of it).
//
// vLLM's OpenAI server is FastAPI on Starlette: a JSON body is parsed by Python's json.loads over the
// raw bytes, then validated by pydantic. A gateway that reads the body any differently can be fooled:
// a body the gateway takes for "not JSON" but the engine runs would get a cost of 1 and keep the
// client's own priority. So the gateway reads it as json.loads does:
//
//   - the encoding is detected as json.detect_encoding does: a UTF-8 byte order mark is skipped (the
//     engine accepts it), and a body it would decode as UTF-16 or UTF-32 (a UTF-16/32 byte order
//     mark, or a NUL among the first bytes) is one the gateway does not read: docNotUTF8, which both
//     handlers refuse with 400;
//   - NaN, Infinity and -Infinity are numbers (json.loads' parse_constant); otherwise the grammar is
//     RFC 8259, as encoding/json checks it;
//   - member names are compared after unescaping ("\u006e" is "n"), and of repeated names the last
//     counts, as in a Python dict.
//
// Cost: one validity pass (encoding/json's scanner, no allocation) and a walk of the top-level members
// that skips each value in place without decoding it. A body with NaN or Infinity outside strings is
// copied once for the validity pass.

package gateway

import (
	"bytes"
	"encoding/json"
	"strconv"
)

// docKind is what the engine makes of a body.
type docKind int

const (
	// docInvalid: not JSON to the engine, which answers its own 400.
	docInvalid docKind = iota
	// docOther: JSON whose top level is not an object (pydantic answers its own 400).
	docOther
	// docObject: a JSON object.
	docObject
	// docNotUTF8: JSON the engine would decode from UTF-16 or UTF-32, which the gateway does not read.
	docNotUTF8
)

// engineJSON classifies body as the engine would parse it. doc is body without a UTF-8 byte order
// mark (prefix is the number of bytes skipped, 0 or 3); for docObject and docOther doc is valid JSON
// in the engine's dialect, so the walks below need no error handling.
func engineJSON(body []byte) (doc []byte, prefix int, kind docKind) {
	switch {
	case bytes.HasPrefix(body, []byte{0xef, 0xbb, 0xbf}):
		prefix = 3
	case bytes.HasPrefix(body, []byte{0xfe, 0xff}), bytes.HasPrefix(body, []byte{0xff, 0xfe}):
		return nil, 0, docNotUTF8 // UTF-16 or UTF-32 (FF FE 00 00) byte order mark
	case (len(body) >= 4 || len(body) == 2) && (body[0] == 0 || body[1] == 0):
		return nil, 0, docNotUTF8 // json.detect_encoding: utf-16-be/le or utf-32-be/le
	}
	doc = body[prefix:]
	if !json.Valid(doc) {
		plain, found := withoutPythonConstants(doc)
		if !found || !json.Valid(plain) {
			return doc, prefix, docInvalid
		}
	}
	if i := skipSpace(doc, 0); i < len(doc) && doc[i] == '{' {
		return doc, prefix, docObject
	}
	return doc, prefix, docOther
}

// withoutPythonConstants returns a copy of doc in which each NaN, Infinity and -Infinity outside a
// string is a JSON number of the same length between spaces (" 0 ", " 0      ", " -0      ", so that
// it cannot merge with a neighbour into one number as "1NaN" would), and whether there was one; doc
// itself is not changed, so positions in the copy are positions in doc.
func withoutPythonConstants(doc []byte) ([]byte, bool) {
	var out []byte
	replace := func(at int, word, with string) {
		if out == nil {
			out = bytes.Clone(doc)
		}
		copy(out[at:at+len(word)], with)
	}
	for i := 0; i < len(doc); i++ {
		switch {
		case doc[i] == '"':
			i = stringEnd(doc, i) - 1
		case bytes.HasPrefix(doc[i:], []byte("NaN")):
			replace(i, "NaN", " 0 ")
			i += 2
		case bytes.HasPrefix(doc[i:], []byte("Infinity")):
			replace(i, "Infinity", " 0      ")
			i += 7
		case bytes.HasPrefix(doc[i:], []byte("-Infinity")):
			replace(i, "-Infinity", " -0      ")
			i += 8
		}
	}
	return out, out != nil
}

// member is one top-level member of an object: its name as written (quotes and escapes included),
// which starts at doc[nameStart], and its value's bytes doc[start:end].
type member struct {
	name       []byte
	nameStart  int
	start, end int
}

// members calls fn for each member of the object doc, in order. doc must be valid JSON whose top
// level is an object (docObject).
func members(doc []byte, fn func(member)) {
	i := skipSpace(doc, 0) + 1 // past '{'
	for {
		i = skipSpace(doc, i)
		if i >= len(doc) || doc[i] != '"' {
			return // the '}' of an empty object
		}
		nameStart, nameEnd := i, stringEnd(doc, i)
		name := doc[i:nameEnd]
		i = skipSpace(doc, skipSpace(doc, nameEnd)+1) // past ':'
		end := valueEnd(doc, i)
		fn(member{name: name, nameStart: nameStart, start: i, end: end})
		i = skipSpace(doc, end)
		if i >= len(doc) || doc[i] != ',' {
			return // '}'
		}
		i++
	}
}

// isName reports whether the quoted member name raw is name, escapes (\u0070...) included.
func isName(raw []byte, name string) bool {
	if len(raw) == len(name)+2 && string(raw[1:len(raw)-1]) == name {
		return true
	}
	if bytes.IndexByte(raw, '\\') < 0 {
		return false
	}
	var decoded string
	return json.Unmarshal(raw, &decoded) == nil && decoded == name
}

// elements calls fn with each element of the array value (valid JSON, starting with '['), in order,
// until fn returns false.
func elements(value []byte, fn func([]byte) bool) {
	i := 1 // past '['
	for {
		i = skipSpace(value, i)
		if i >= len(value) || value[i] == ']' {
			return
		}
		end := valueEnd(value, i)
		if !fn(value[i:end]) {
			return
		}
		i = skipSpace(value, end)
		if i >= len(value) || value[i] != ',' {
			return
		}
		i++
	}
}

// jsonType names the JSON type of a valid value by its first byte, as the error messages say it.
func jsonType(value []byte) string {
	if len(value) == 0 {
		return "nothing"
	}
	switch value[0] {
	case '"':
		return "a string"
	case '[':
		return "a list"
	case '{':
		return "an object"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	default:
		return "a number"
	}
}

// isNumber reports whether the valid value is a number (NaN and ±Infinity included).
func isNumber(value []byte) bool {
	return len(value) > 0 && (value[0] == '-' || value[0] >= '0' && value[0] <= '9' || value[0] == 'N' || value[0] == 'I')
}

// withMember returns a copy of the object doc (docObject) in which every top-level member named name
// has the value value (raw JSON), or, if there is none, in which that member comes first. Every other
// byte is kept: other members, their order, spacing and number spellings are as the client wrote them.
func withMember(doc []byte, name string, value []byte) []byte {
	var spans []member
	empty := true
	members(doc, func(m member) {
		empty = false
		if isName(m.name, name) {
			spans = append(spans, m)
		}
	})
	out := make([]byte, 0, len(doc)+len(name)+len(value)+4)
	if len(spans) == 0 {
		open := skipSpace(doc, 0) + 1
		out = append(out, doc[:open]...)
		out = strconv.AppendQuote(out, name)
		out = append(out, ':')
		out = append(out, value...)
		if !empty {
			out = append(out, ',')
		}
		return append(out, doc[open:]...)
	}
	last := 0
	for _, m := range spans {
		out = append(out, doc[last:m.start]...)
		out = append(out, value...)
		last = m.end
	}
	return append(out, doc[last:]...)
}

// withoutMember returns the object doc (docObject) without its top-level members named name. The other
// members keep their bytes and order; the spacing between members is not kept (they are joined by ",").
func withoutMember(doc []byte, name string) []byte {
	return appendWithoutMember(make([]byte, 0, len(doc)), doc, name)
}

// appendWithoutMember appends withoutMember(doc, name) to out.
func appendWithoutMember(out, doc []byte, name string) []byte {
	out = append(out, '{')
	open := len(out)
	members(doc, func(m member) {
		if isName(m.name, name) {
			return
		}
		if len(out) > open {
			out = append(out, ',')
		}
		out = append(out, doc[m.nameStart:m.end]...)
	})
	return append(out, '}')
}

// engineBool reads a valid JSON value as pydantic's lax bool validation does (vLLM's request models
// declare stream, include_usage, use_beam_search and the like as bool, and FastAPI validates the
// parsed body in lax mode): true, false; a number equal to 1 or 0 (1, 1.0, 1e0, -0; Python's float
// rounding, which strconv.ParseFloat shares); a string that is, ignoring ASCII case only, one of
// 1 t y on yes true or 0 f n no off false (no trimming; escapes decoded). ok is false for null and for
// anything pydantic refuses (the engine then answers 422 itself). Source: pydantic-core's str_as_bool
// and int/float bool checks, as pydantic 2.14.4 with FastAPI 0.136.3 (vLLM 0.32.0's lock) answered
// testdata/pydantic_bool.json.
func engineBool(value []byte) (b, ok bool) {
	if len(value) == 0 {
		return false, false
	}
	switch value[0] {
	case 't':
		return true, string(value) == "true"
	case 'f':
		return false, string(value) == "false"
	case '"':
		s := value[1 : len(value)-1]
		if bytes.IndexByte(value, '\\') >= 0 {
			var decoded string
			if json.Unmarshal(value, &decoded) != nil {
				return false, false
			}
			s = []byte(decoded)
		}
		for _, word := range [...]string{"1", "t", "y", "on", "yes", "true"} {
			if asciiEqualFold(s, word) {
				return true, true
			}
		}
		for _, word := range [...]string{"0", "f", "n", "no", "off", "false"} {
			if asciiEqualFold(s, word) {
				return false, true
			}
		}
		return false, false
	}
	if !isNumber(value) {
		return false, false
	}
	f, err := strconv.ParseFloat(string(value), 64)
	switch {
	case err != nil:
		return false, false
	case f == 1:
		return true, true
	case f == 0:
		return false, true
	}
	return false, false
}

// asciiEqualFold reports whether s is word, ignoring the case of ASCII letters only (Rust's
// eq_ignore_ascii_case; strings.EqualFold would also fold "ſ" to "s" and "K" to "k").
func asciiEqualFold(s []byte, word string) bool {
	if len(s) != len(word) {
		return false
	}
	for i := range len(s) {
		c := s[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != word[i] {
			return false
		}
	}
	return true
}
