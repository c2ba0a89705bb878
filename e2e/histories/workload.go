package histories

import (
	"fmt"
	"math/rand"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// keyInfo is one idempotency key the clients use: its buyer and quantity, and what
// its last answer was (to steer retries, confirms and cancels).
type keyInfo struct {
	key     string
	user    string
	qty     int
	variant int          // the variant its reserves name, -1 for a drop without variants
	last    atomic.Value // string: the last outcome heard for it
}

// keyPool is the keys of one history, shared by its clients.
type keyPool struct {
	mu        sync.Mutex
	keys      []*keyInfo
	admitted  []*keyInfo // heard 201 / already_reserved
	ambiguous []*keyInfo // heard 503 or nothing
	cancelled []*keyInfo // recently cancelled (for duplicated cancels)
	next      int
}

func (p *keyPool) fresh(user string, qty, variant int) *keyInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.next++
	k := &keyInfo{key: fmt.Sprintf("k%d", p.next), user: user, qty: qty, variant: variant}
	k.last.Store("")
	p.keys = append(p.keys, k)
	return k
}

func pick[T any](rng *rand.Rand, items []T) (T, bool) {
	var zero T
	if len(items) == 0 {
		return zero, false
	}
	return items[rng.Intn(len(items))], true
}

func (p *keyPool) any(rng *rand.Rand) (*keyInfo, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return pick(rng, p.keys)
}

func (p *keyPool) from(rng *rand.Rand, list *[]*keyInfo) (*keyInfo, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return pick(rng, *list)
}

func (p *keyPool) note(k *keyInfo, list *[]*keyInfo) {
	p.mu.Lock()
	defer p.mu.Unlock()
	*list = append(*list, k)
	if len(*list) > 64 {
		*list = (*list)[len(*list)-64:]
	}
}

// heard records a reserve's answer for steering.
func (w *world) heard(k *keyInfo, c *call) {
	k.last.Store(c.Ans.Outcome)
	switch {
	case c.Ans.Kind != ansDefinite:
		w.keys.note(k, &w.keys.ambiguous)
	case c.Ans.Outcome == "admitted" || c.Ans.Outcome == "already_reserved":
		w.keys.note(k, &w.keys.admitted)
	}
}

// client runs one buyer goroutine until stop is closed.
func (w *world) client(id int, stop <-chan struct{}, wg *sync.WaitGroup) {
	defer wg.Done()
	rng := rand.New(rand.NewSource(w.seed*1000 + int64(id)))
	hc := newHTTPClient()
	defer hc.CloseIdleConnections()
	for {
		select {
		case <-stop:
			return
		default:
		}
		sc := w.upSidecar(rng)
		if sc == nil {
			time.Sleep(10 * time.Millisecond)
			continue
		}
		w.act(rng, hc, id, sc)
		pace := w.pace.Load()
		pause := time.Duration(pace/2 + rng.Int63n(pace+1))
		select {
		case <-stop:
			return
		case <-time.After(pause):
		}
	}
}

func (w *world) upSidecar(rng *rand.Rand) *sidecar {
	var up []*sidecar
	for _, sc := range w.sidecars {
		if _, _, ok := sc.state(); ok {
			up = append(up, sc)
		}
	}
	sc, _ := pick(rng, up)
	return sc
}

func (w *world) user(rng *rand.Rand) string { return fmt.Sprintf("u%d", rng.Intn(w.cfg.Users)) }

func quantity(rng *rand.Rand) int {
	if rng.Intn(10) < 7 {
		return 1
	}
	return 2
}

// act is one client step: one API call.
func (w *world) act(rng *rand.Rand, hc *http.Client, id int, sc *sidecar) {
	r := rng.Intn(100)
	switch {
	case r < 30:
		variant := -1
		if n := len(w.cfg.Variants); n > 0 {
			variant = rng.Intn(n)
		}
		k := w.keys.fresh(w.user(rng), quantity(rng), variant)
		w.reserve(hc, id, sc, k, k.user, k.qty)
	case r < 45:
		k, ok := w.keys.from(rng, &w.keys.ambiguous)
		if !ok || rng.Intn(10) < 4 {
			k, ok = w.keys.any(rng)
		}
		if ok {
			w.reserve(hc, id, sc, k, k.user, k.qty)
		}
	case r < 48:
		// The same key with another buyer or quantity.
		if k, ok := w.keys.any(rng); ok {
			user, qty := k.user, k.qty
			if rng.Intn(2) == 0 {
				user = w.user(rng)
			} else {
				qty = 3 - qty
			}
			w.reserve(hc, id, sc, k, user, qty)
		}
	case r < 60:
		k, ok := w.keys.from(rng, &w.keys.admitted)
		if !ok || rng.Intn(10) < 2 {
			k, ok = w.keys.any(rng)
		}
		if ok {
			w.settle(hc, id, sc, kConfirm, k.key)
		}
	case r < 70:
		k, ok := w.keys.from(rng, &w.keys.cancelled)
		if !ok || rng.Intn(10) < 6 {
			k, ok = w.keys.from(rng, &w.keys.admitted)
		}
		if !ok || rng.Intn(10) < 1 {
			k, ok = w.keys.any(rng)
		}
		if !ok {
			break
		}
		w.keys.note(k, &w.keys.cancelled)
		if rng.Intn(10) < 3 {
			// The same cancel twice at once, through two sidecars (the second on
			// a client row of its own).
			other := w.upSidecar(rng)
			if other == nil {
				other = sc
			}
			var both sync.WaitGroup
			both.Add(1)
			go func() {
				defer both.Done()
				w.settle(hc, 3*w.cfg.Clients+id, other, kCancel, k.key)
			}()
			w.settle(hc, id, sc, kCancel, k.key)
			both.Wait()
			break
		}
		w.settle(hc, id, sc, kCancel, k.key)
	case r < 72:
		// A key nobody reserved.
		key := fmt.Sprintf("never%d", rng.Intn(1000))
		w.settle(hc, id, sc, []callKind{kConfirm, kCancel, kLookup}[rng.Intn(3)], key)
	case r < 88 || w.cfg.NoShow:
		if k, ok := w.keys.any(rng); ok {
			w.settle(hc, id, sc, kLookup, k.key)
		}
	default:
		w.show(hc, id, sc)
	}
}

func (w *world) reserve(hc *http.Client, id int, sc *sidecar, k *keyInfo, user string, qty int) {
	c := &call{Kind: kReserve, Key: k.key, User: user, Qty: qty, Variant: k.variant}
	body := map[string]any{"key": k.key, "user": user, "quantity": qty}
	if k.variant >= 0 {
		body["variant"] = variantName(k.variant)
	}
	if c, ok := w.rec.do(hc, id, sc, c, "POST", fmt.Sprintf("/v1/drops/%s/reservations", w.drop), body); ok && user == k.user && qty == k.qty {
		w.heard(k, c)
	}
}

func (w *world) settle(hc *http.Client, id int, sc *sidecar, kind callKind, key string) {
	c := &call{Kind: kind, Key: key}
	path := fmt.Sprintf("/v1/drops/%s/reservations/%s", w.drop, key)
	switch kind {
	case kConfirm:
		w.rec.do(hc, id, sc, c, "POST", path+"/confirm", nil)
	case kCancel:
		w.rec.do(hc, id, sc, c, "POST", path+"/cancel", nil)
	default:
		w.rec.do(hc, id, sc, c, "GET", path, nil)
	}
}

func (w *world) show(hc *http.Client, id int, sc *sidecar) {
	w.rec.do(hc, id, sc, &call{Kind: kShow}, "GET", "/v1/drops/"+w.drop, nil)
}

// audit looks every key up once, and the drop, after the clients stopped: the
// end state, as the sidecars answer it, is part of the history too.
func (w *world) audit() {
	w.keys.mu.Lock()
	keys := append([]*keyInfo(nil), w.keys.keys...)
	w.keys.mu.Unlock()
	var wg sync.WaitGroup
	work := make(chan string)
	for id := 0; id < w.cfg.Clients; id++ {
		wg.Add(1)
		go func(id int) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(w.seed*1000 + 500 + int64(id)))
			hc := newHTTPClient()
			defer hc.CloseIdleConnections()
			for key := range work {
				sc := w.upSidecar(rng)
				if sc == nil {
					continue
				}
				if key == "" {
					w.show(hc, id, sc)
				} else {
					w.settle(hc, id, sc, kLookup, key)
				}
			}
		}(id)
	}
	if !w.cfg.NoShow {
		work <- ""
	}
	for _, k := range keys {
		work <- k.key
	}
	if !w.cfg.NoShow {
		work <- ""
	}
	close(work)
	wg.Wait()
}
