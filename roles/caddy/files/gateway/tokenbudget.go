// The per-user token ledger behind token_usage's budgets: the prompt and completion tokens each key's
// answers used today (UTC), kept in memory and in a JSON file, so a gateway restart loses none; and the
// tokens of each key's answers that ended in the last minute (sliding), kept in memory only, so a
// restart forgets at most one minute of them.
//
// A day is a UTC calendar day: the counts start again at 00:00 UTC, which is the reset time a refused
// user is told. The file is written at most once a second while counts change (to a temporary file
// renamed over the old one, so a crash leaves the old or the new file, never half of one) and when the
// config that uses it is unloaded (a reload or a stop). A process killed without a stop loses at most
// the last second's counts. A file that cannot be read or parsed starts the day from zero and is logged;
// it never keeps the gateway from serving.

package gateway

import (
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// ledgerFile is the file's format.
type ledgerFile struct {
	// Day is the UTC date the counts are for, YYYY-MM-DD.
	Day string `json:"day"`
	// Tokens is each key's prompt + completion tokens on Day.
	Tokens map[string]int64 `json:"tokens"`
}

// tokenLedger is one ledger file's counts, shared by every handler (and config) that names the file.
type tokenLedger struct {
	path   string
	logger *zap.Logger
	now    func() time.Time // time.Now; tests move the clock

	mu      sync.Mutex
	day     string
	tokens  map[string]int64
	recent  map[string][]spent // per key, oldest first, none older than budgetWindow
	dirty   bool
	started bool
	stop    chan struct{}
	done    chan struct{}
}

// budgetWindow is the span a per-minute budget counts over, ending now.
const budgetWindow = time.Minute

// spent is one answer's tokens and when they were counted.
type spent struct {
	at     time.Time
	tokens int64
}

// ledgers shares a ledger across graceful reloads (the new config finds the old one's counts).
var ledgers = caddy.NewUsagePool()

func utcDay(t time.Time) string { return t.UTC().Format(time.DateOnly) }

// nextUTCMidnight is when the day of t ends.
func nextUTCMidnight(t time.Time) time.Time {
	y, m, d := t.UTC().Date()
	return time.Date(y, m, d+1, 0, 0, 0, 0, time.UTC)
}

// loadLedger reads path's counts if they are today's.
func loadLedger(path string, logger *zap.Logger, now func() time.Time) *tokenLedger {
	l := &tokenLedger{path: path, logger: logger, now: now, day: utcDay(now()), tokens: map[string]int64{},
		recent: map[string][]spent{}}
	data, err := os.ReadFile(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		logger.Error("token_usage: cannot read the token ledger; today's counts start from zero", zap.String("path", path), zap.Error(err))
	default:
		var file ledgerFile
		if err := json.Unmarshal(data, &file); err != nil {
			logger.Error("token_usage: the token ledger is not valid JSON; today's counts start from zero", zap.String("path", path), zap.Error(err))
		} else if file.Day == l.day {
			for key, n := range file.Tokens {
				if n > 0 {
					l.tokens[key] = n
				}
			}
		}
	}
	return l
}

// rollover starts a new day's counts when the UTC day has changed. Callers hold mu.
func (l *tokenLedger) rollover(t time.Time) {
	if day := utcDay(t); day != l.day {
		l.day, l.tokens, l.dirty = day, map[string]int64{}, true
	}
}

// used returns key's tokens today and when today ends.
func (l *tokenLedger) used(key string) (int64, time.Time) {
	t := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.rollover(t)
	return l.tokens[key], nextUTCMidnight(t)
}

// prune drops key's answers older than the window ending at t. Callers hold mu.
func (l *tokenLedger) prune(key string, t time.Time) []spent {
	list := l.recent[key]
	drop := 0
	for drop < len(list) && !list[drop].at.After(t.Add(-budgetWindow)) {
		drop++
	}
	if drop == len(list) {
		delete(l.recent, key)
		return nil
	}
	if drop > 0 {
		list = append(list[:0], list[drop:]...)
		l.recent[key] = list
	}
	return list
}

// lastMinute returns key's tokens in the last minute and, when budget > 0, the moment they drop
// below budget as the oldest answers leave the window (now when they already are below it).
func (l *tokenLedger) lastMinute(key string, budget int64) (int64, time.Time) {
	t := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	list := l.prune(key, t)
	var used int64
	for _, s := range list {
		used += s.tokens
	}
	free, left := t, used
	for _, s := range list {
		if budget <= 0 || left < budget {
			break
		}
		left -= s.tokens
		free = s.at.Add(budgetWindow)
	}
	return used, free
}

// add counts tokens against key today and in the last minute, and has the file written soon.
func (l *tokenLedger) add(key string, tokens int64) {
	if tokens <= 0 || key == "" {
		return
	}
	t := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.rollover(t)
	l.tokens[key] += tokens
	l.recent[key] = append(l.prune(key, t), spent{at: t, tokens: tokens})
	l.dirty = true
	if !l.started { // started on the first count, so `caddy validate` never writes the file
		l.started = true
		l.stop, l.done = make(chan struct{}), make(chan struct{})
		go l.flushEverySecond()
	}
}

func (l *tokenLedger) flushEverySecond() {
	defer close(l.done)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			l.flush()
		case <-l.stop:
			l.flush()
			return
		}
	}
}

// flush writes the counts if they changed since the last write.
func (l *tokenLedger) flush() {
	l.mu.Lock()
	if !l.dirty {
		l.mu.Unlock()
		return
	}
	data, err := json.Marshal(ledgerFile{Day: l.day, Tokens: l.tokens})
	l.dirty = false
	l.mu.Unlock()
	if err == nil {
		err = writeFileAtomic(l.path, data)
	}
	if err != nil {
		l.logger.Error("token_usage: cannot write the token ledger", zap.String("path", l.path), zap.Error(err))
		l.mu.Lock()
		l.dirty = true
		l.mu.Unlock()
	}
}

// Destruct writes the last counts when no config uses the ledger any more.
func (l *tokenLedger) Destruct() error {
	l.mu.Lock()
	started := l.started
	l.mu.Unlock()
	if started {
		close(l.stop)
		<-l.done
	}
	return nil
}

// writeFileAtomic replaces path with data (mode 0600) through a temporary file in the same directory.
func writeFileAtomic(path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // gone after the rename; removes a failed write's leftover
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
