package histories

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"
)

// callKind is what a client asked.
type callKind uint8

const (
	kReserve callKind = iota
	kConfirm
	kCancel
	kLookup
	kShow
	kApply
)

var kindNames = [...]string{"reserve", "confirm", "cancel", "lookup", "show", "apply"}

// answerKind is how much an answer says.
type answerKind uint8

const (
	// ansDefinite: an answer that says what happened.
	ansDefinite answerKind = iota
	// ansFailed: 503 (throttled, unavailable), or a 404 naming the drop unknown:
	// nothing was changed (a reserve may have been admitted and taken back).
	ansFailed
	// ansUnknown: no answer (a timeout, a reset connection).
	ansUnknown
)

// answer is what came back, with the fields the model reads.
type answer struct {
	Kind      answerKind
	Status    int
	Outcome   string
	State     string
	User      string
	Qty       int
	Remaining int
	Path      string
	Message   string
	Err       string
	// Variant: the reservation's, as the answer names it ("" when it names none);
	// Variants: a drop's GET, what each variant has left (by index), or nil.
	Variant  string
	Variants []int
}

// applyChange is what an apply of the manifest changed.
type applyChange struct {
	What    string // "limit", "ends", "gate", "reconcile"
	Limit   int    // limit: the drop's limitedQuantity, or variant Variant's quantity
	Variant int    // limit: the variant changed, -1 for the drop's limitedQuantity
	Ended   bool
	Gate    bool
}

// call is one recorded operation: what was asked, when (ns since the history's
// start, monotonic), and what came back.
type call struct {
	Kind    callKind
	Client  int
	Sidecar int
	Key     string
	User    string
	Qty     int
	Variant int // a reserve's variant index, -1 for a drop without variants
	Apply   applyChange
	Invoke  int64
	Return  int64
	Ans     answer
}

func (c *call) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "[%8.3fs..", float64(c.Invoke)/1e9)
	if c.Return >= unbounded {
		b.WriteString("      ∞]")
	} else {
		fmt.Fprintf(&b, "%8.3fs]", float64(c.Return)/1e9)
	}
	fmt.Fprintf(&b, " c%d ", c.Client)
	switch c.Kind {
	case kApply:
		fmt.Fprintf(&b, "apply %s", c.Apply.What)
		switch c.Apply.What {
		case "limit":
			if c.Apply.Variant >= 0 {
				fmt.Fprintf(&b, " %s", variantName(c.Apply.Variant))
			}
			fmt.Fprintf(&b, "=%d", c.Apply.Limit)
		case "ends":
			fmt.Fprintf(&b, " ended=%t", c.Apply.Ended)
		case "gate":
			fmt.Fprintf(&b, " enabled=%t", c.Apply.Gate)
		}
	case kShow:
		fmt.Fprintf(&b, "s%d GET drop", c.Sidecar)
	case kReserve:
		fmt.Fprintf(&b, "s%d reserve %s %s x%d", c.Sidecar, c.Key, c.User, c.Qty)
		if c.Variant >= 0 {
			fmt.Fprintf(&b, " %s", variantName(c.Variant))
		}
	default:
		fmt.Fprintf(&b, "s%d %s %s", c.Sidecar, kindNames[c.Kind], c.Key)
	}
	a := c.Ans
	switch a.Kind {
	case ansUnknown:
		fmt.Fprintf(&b, " -> no answer: %s", a.Err)
	default:
		if c.Kind == kApply {
			if a.Err != "" {
				fmt.Fprintf(&b, " -> %s", a.Err)
			} else {
				b.WriteString(" -> ok")
			}
			break
		}
		fmt.Fprintf(&b, " -> %d %s", a.Status, a.Outcome)
		if a.State != "" {
			fmt.Fprintf(&b, " state=%s", a.State)
		}
		if a.User != "" && c.Kind != kReserve {
			fmt.Fprintf(&b, " user=%s x%d", a.User, a.Qty)
		}
		if a.Remaining >= 0 {
			fmt.Fprintf(&b, " remaining=%d", a.Remaining)
		}
		if a.Variants != nil {
			fmt.Fprintf(&b, " variants=%v", a.Variants)
		}
		if a.Path == "fallback" {
			b.WriteString(" (fallback)")
		}
		if a.Kind == ansFailed && a.Message != "" {
			fmt.Fprintf(&b, " %q", a.Message)
		}
	}
	return b.String()
}

// recorder collects a history's calls.
type recorder struct {
	start time.Time
	mu    sync.Mutex
	calls []*call
	// dialFailed counts calls that never reached a sidecar (connection refused):
	// left out, they changed nothing.
	dialFailed int
}

func (r *recorder) now() int64 { return int64(time.Since(r.start)) }

func (r *recorder) add(c *call) {
	r.mu.Lock()
	r.calls = append(r.calls, c)
	r.mu.Unlock()
}

func (r *recorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.calls)
}

// requestTimeout bounds one HTTP call; past it the call has no answer.
const requestTimeout = 15 * time.Second

func newHTTPClient() *http.Client {
	return &http.Client{
		Timeout: requestTimeout,
		Transport: &http.Transport{
			MaxIdleConnsPerHost: 4,
			IdleConnTimeout:     4 * time.Second, // below the sidecar's 10 s keep-alive limit
			DialContext:         (&net.Dialer{Timeout: 2 * time.Second}).DialContext,
		},
	}
}

// do sends one API call to sidecar sc and records it; ok is false when the call
// never reached the sidecar (it is then not recorded).
func (r *recorder) do(hc *http.Client, client int, sc *sidecar, c *call, method, path string, body any) (*call, bool) {
	var reader io.Reader
	if body != nil {
		raw, _ := json.Marshal(body)
		reader = bytes.NewReader(raw)
	}
	req, err := http.NewRequest(method, sc.base()+path, reader)
	if err != nil {
		panic(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	c.Client = client
	c.Sidecar = sc.index
	c.Invoke = r.now()
	resp, err := hc.Do(req)
	if err != nil {
		c.Return = r.now()
		if neverSent(err) {
			r.mu.Lock()
			r.dialFailed++
			r.mu.Unlock()
			return c, false
		}
		c.Ans = answer{Kind: ansUnknown, Err: shortError(err), Remaining: -1}
		r.add(c)
		return c, true
	}
	raw, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	c.Return = r.now()
	if err != nil {
		c.Ans = answer{Kind: ansUnknown, Status: resp.StatusCode, Err: shortError(err), Remaining: -1}
		r.add(c)
		return c, true
	}
	c.Ans = parseAnswer(resp, raw)
	r.add(c)
	return c, true
}

func parseAnswer(resp *http.Response, raw []byte) answer {
	var body struct {
		Outcome   string `json:"outcome"`
		State     string `json:"state"`
		User      string `json:"user"`
		Quantity  int    `json:"quantity"`
		Remaining *int   `json:"remaining"`
		Path      string `json:"path"`
		Message   string `json:"message"`
		Variant   string `json:"variant"`
		Variants  []struct {
			Name      string `json:"name"`
			Remaining int    `json:"remaining"`
		} `json:"variants"`
	}
	a := answer{Status: resp.StatusCode, Remaining: -1}
	if err := json.Unmarshal(raw, &body); err != nil {
		a.Outcome = "unreadable"
		a.Message = string(raw)
		return a
	}
	a.Outcome, a.State, a.User, a.Qty, a.Message = body.Outcome, body.State, body.User, body.Quantity, body.Message
	if body.Remaining != nil {
		a.Remaining = *body.Remaining
	}
	a.Path = body.Path
	a.Variant = body.Variant
	for i, v := range body.Variants {
		if v.Name != variantName(i) {
			a.Outcome = "unreadable"
			a.Message = "variants out of order: " + string(raw)
			return a
		}
		a.Variants = append(a.Variants, v.Remaining)
	}
	if resp.Header.Get("Dropgate-Path") == "fallback" {
		a.Path = "fallback"
	}
	switch {
	case resp.StatusCode == http.StatusServiceUnavailable:
		a.Kind = ansFailed
	case resp.StatusCode == http.StatusNotFound && strings.HasPrefix(body.Message, "no drop named"):
		a.Kind = ansFailed
	}
	return a
}

// neverSent: the connection was refused or could not be made, so the request
// never reached a sidecar.
func neverSent(err error) bool {
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return true
	}
	return false
}

func shortError(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	s := err.Error()
	if len(s) > 80 {
		s = s[:80]
	}
	return s
}
