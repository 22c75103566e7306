// The request body, read once per request by whichever of this package's handlers needs it first
// (request_model, request_cost, request_priority), and held in memory for the others and for the
// proxy.
//
// Each of these handlers reads the whole body, bounded by its max_size, and puts it back in r.Body as
// a heldBody. The next one finds the heldBody, unread, and uses its bytes as they are: one read from
// the client and one buffer per request, however many of the handlers run. request_priority, which
// changes the body, puts a new heldBody in its place. Nothing else in Caddy knows the type: any other
// reader (reverse_proxy, {http.request.body}) reads it as a plain io.ReadCloser.

package gateway

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// DefaultBodyMax is the most body bytes request_cost and request_priority read unless max_size says
// otherwise, the same bound as request_model's (DefaultModelBodyMax).
const DefaultBodyMax = DefaultModelBodyMax

// heldBody is a request body this package has read into memory and put back in r.Body.
type heldBody struct {
	data []byte
	rd   bytes.Reader
}

func newHeldBody(data []byte) *heldBody {
	b := &heldBody{data: data}
	b.rd.Reset(data)
	return b
}

func (b *heldBody) Read(p []byte) (int, error)         { return b.rd.Read(p) }
func (b *heldBody) WriteTo(w io.Writer) (int64, error) { return b.rd.WriteTo(w) }
func (b *heldBody) Close() error                       { return nil }

// unread reports whether nothing has been read from the body since it was put back.
func (b *heldBody) unread() bool { return b.rd.Len() == len(b.data) }

// hasJSONBody reports a request that may carry a body and says it is JSON (Content-Type
// application/json, parameters ignored, any case, spaces trimmed). vLLM refuses every other media
// type on its JSON endpoints with its own error (validate_json_request: the media type, lowercased,
// must be exactly application/json), so a body this does not look at is never one the engine runs.
func hasJSONBody(r *http.Request) bool {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return false
	}
	mediaType, _, _ := strings.Cut(r.Header.Get("Content-Type"), ";")
	return strings.EqualFold(strings.TrimSpace(mediaType), "application/json")
}

// bufferedBody returns r's whole body (at most maxSize bytes) and leaves it in r.Body, unread, for
// the next handler. A body another of this package's handlers has already read is not read again.
// Errors: errBodyTooLarge (declared or found larger than maxSize; at most maxSize+1 bytes are read),
// or what reading the body returned (see bodyReadError).
func bufferedBody(r *http.Request, maxSize int64) ([]byte, error) {
	if held, ok := r.Body.(*heldBody); ok && held.unread() {
		if int64(len(held.data)) > maxSize {
			return nil, errBodyTooLarge
		}
		return held.data, nil
	}
	if r.ContentLength > maxSize {
		return nil, errBodyTooLarge
	}
	body, err := readBody(r.Body, r.ContentLength, maxSize)
	if err != nil {
		return nil, err
	}
	// The server closes the body it made when the handler returns; closing it now, once it is read,
	// is what Caddy's own {http.request.body} does before it puts a buffer in its place.
	_ = r.Body.Close()
	r.Body = newHeldBody(body)
	return body, nil
}

// replaceBody puts body in r in place of the one read, with the length headers to match: a body that
// came with a Content-Length gets the new length, a chunked one (length -1) stays chunked.
func replaceBody(r *http.Request, body []byte) {
	r.Body = newHeldBody(body)
	if r.ContentLength >= 0 {
		r.ContentLength = int64(len(body))
		if r.Header.Get("Content-Length") != "" {
			r.Header.Set("Content-Length", fmt.Sprint(len(body)))
		}
	}
}

// bodyReadError turns an error from bufferedBody into the handler's error, prefixed with the
// handler's name: errBodyTooLarge and request_body's max_size (whose own 413 passes through
// unchanged) are 413; a client that stops sending gets 408 on the server's read timeout; any other
// failure (a truncated body, a connection gone) is the client's: 400.
func bodyReadError(handler string, maxSize int64, err error, logger *zap.Logger) error {
	if errors.Is(err, errBodyTooLarge) {
		return caddyhttp.Error(http.StatusRequestEntityTooLarge,
			fmt.Errorf("%s: request body larger than %d bytes", handler, maxSize))
	}
	var handlerErr caddyhttp.HandlerError
	if errors.As(err, &handlerErr) {
		return err
	}
	if logger != nil {
		logger.Debug(handler+": reading the request body failed", zap.Error(err))
	}
	var maxBytes *http.MaxBytesError
	if errors.As(err, &maxBytes) {
		return caddyhttp.Error(http.StatusRequestEntityTooLarge, err)
	}
	var netErr net.Error
	if errors.As(err, &netErr) && netErr.Timeout() {
		return caddyhttp.Error(http.StatusRequestTimeout, fmt.Errorf("%s: reading the request body: %w", handler, err))
	}
	return caddyhttp.Error(http.StatusBadRequest, fmt.Errorf("%s: reading the request body: %w", handler, err))
}

var errBodyTooLarge = errors.New("request body too large")

// readBody reads all of body, or fails with errBodyTooLarge after limit+1 bytes. declared is the
// request's Content-Length (-1 if unknown). The buffer starts small and at most doubles, so it never
// exceeds twice what the client has actually sent (a declared length alone reserves nothing), and it
// stops at declared+1 so a body of the declared length fits with one byte to spare for seeing EOF.
func readBody(body io.Reader, declared, limit int64) ([]byte, error) {
	body = io.LimitReader(body, limit+1)
	size := int64(512)
	if declared > 0 {
		size = min(declared+1, 64<<10)
	}
	buf := make([]byte, 0, size)
	for {
		if len(buf) == cap(buf) {
			next := 2 * int64(cap(buf))
			if declared > 0 && int64(len(buf)) <= declared {
				next = min(next, declared+1)
			}
			grown := make([]byte, len(buf), next)
			copy(grown, buf)
			buf = grown
		}
		n, err := body.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if int64(len(buf)) > limit {
			return nil, errBodyTooLarge
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
	}
	// A chunked body may end just past a doubling: keep a right-sized copy for the request's lifetime
	// (a stream can hold it for minutes) rather than up to twice its size.
	if slack := cap(buf) - len(buf); slack > 4096 && slack > len(buf)/4 {
		buf = bytes.Clone(buf)
	}
	return buf, nil
}

// unmarshalBodyReader reads the Caddyfile syntax request_model and request_cost share:
//
//	<directive> <destination placeholder> [{
//		max_size <bytes>
//	}]
//
// Returns the destination and max_size (0 when not given: the handler's default).
func unmarshalBodyReader(d *caddyfile.Dispenser, directive, example string) (string, int64, error) {
	d.Next() // the directive name
	args := d.RemainingArgs()
	if len(args) != 1 {
		return "", 0, d.Errf("%s takes one destination placeholder, e.g. %s, got %d values", directive, example, len(args))
	}
	if err := checkPlaceholder(args[0]); err != nil {
		return "", 0, d.Errf("%s: %v", directive, err)
	}
	var maxSize int64
	for d.NextBlock(0) {
		switch d.Val() {
		case "max_size":
			if !d.NextArg() {
				return "", 0, d.ArgErr()
			}
			n, err := strconv.ParseInt(d.Val(), 10, 64)
			if err != nil || n < 1 {
				return "", 0, d.Errf("max_size %q must be a whole number of bytes >= 1", d.Val())
			}
			maxSize = n
			if d.NextArg() {
				return "", 0, d.ArgErr()
			}
		default:
			return "", 0, d.Errf("unknown %s option %q (max_size)", directive, d.Val())
		}
	}
	return args[0], maxSize, nil
}

// refuseNotUTF8 answers a JSON body the engine would decode from UTF-16 or UTF-32 (docNotUTF8), which
// the gateway does not read: 400 unsupported_encoding, logged as a refusal.
func refuseNotUTF8(w http.ResponseWriter, r *http.Request) error {
	logRefusal(r, CodeUnsupportedEncoding)
	return writeOpenAIError(w, http.StatusBadRequest, "The request body must be JSON encoded as UTF-8.",
		"invalid_request_error", "", CodeUnsupportedEncoding, 0)
}

// replaceDoc puts the rewritten JSON document doc in r in place of body, whose first prefix bytes (a
// UTF-8 byte order mark, which the engine skips) it keeps.
func replaceDoc(r *http.Request, body []byte, prefix int, doc []byte) {
	if prefix > 0 {
		doc = append(body[:prefix:prefix], doc...)
	}
	replaceBody(r, doc)
}
