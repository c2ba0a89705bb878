// A shop's checkout against the dropgate sidecar (see ../README.md): one
// idempotency key per checkout attempt, 503 retried after Retry-After with jitter
// and the same key, confirm after payment, cancel when payment fails, answers read
// by `outcome`.
package main

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"math/big"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"sync"
	"time"
)

var (
	base   = env("DROPGATE_URL", "http://127.0.0.1:7070")
	drop   = env("DROP", "sale")
	prefix = env("PREFIX", "go")
	client = &http.Client{Timeout: 10 * time.Second}
)

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

// answer is what every dropgate answer has: an outcome, and a message on refusals.
type answer struct {
	Outcome string `json:"outcome"`
	Message string `json:"message,omitempty"`
	State   string `json:"state,omitempty"`
}

// call POSTs body to path; a 503 is sent again, same body (same key), after its
// Retry-After plus up to 250 ms of jitter.
func call(path string, body any) (answer, error) {
	payload, err := json.Marshal(body)
	if err != nil {
		return answer{}, err
	}
	for attempt := 1; ; attempt++ {
		resp, err := client.Post(base+path, "application/json", bytes.NewReader(payload))
		if err != nil {
			return answer{}, err
		}
		var a answer
		err = json.NewDecoder(resp.Body).Decode(&a)
		resp.Body.Close()
		if err != nil {
			return answer{}, fmt.Errorf("%s: %w", path, err)
		}
		// Only a 503 with Retry-After asks for the same request again; one without
		// it says why in its message and is not to be sent again as it is.
		retryAfter := resp.Header.Get("Retry-After")
		if resp.StatusCode != http.StatusServiceUnavailable || retryAfter == "" || attempt == 30 {
			return a, nil
		}
		wait, err := strconv.Atoi(retryAfter)
		if err != nil {
			wait = 1
		}
		jitter, _ := rand.Int(rand.Reader, big.NewInt(250))
		time.Sleep(time.Duration(wait)*time.Second + time.Duration(jitter.Int64())*time.Millisecond)
	}
}

// newKey is a random UUID (version 4): one checkout attempt, kept across retries.
func newKey() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

// pay is the shop's payment: here every third buyer's card is declined.
func pay(buyer int) bool { return buyer%3 != 2 }

func checkout(buyer int) (string, error) {
	user := fmt.Sprintf("%s-buyer-%d", prefix, buyer)
	key := newKey()
	path := "/v1/drops/" + url.PathEscape(drop) + "/reservations"
	reserved, err := call(path, map[string]any{"key": key, "user": user, "quantity": 1})
	if err != nil {
		return "", err
	}
	// A hold: `admitted`, or a retry's `already_reserved` of a reservation still active.
	held := reserved.Outcome == "admitted" ||
		(reserved.Outcome == "already_reserved" && reserved.State == "active")
	if !held {
		return reserved.Outcome, nil // sold_out, per_user_limit_exceeded, ...
	}
	reservation := path + "/" + url.PathEscape(key)
	if pay(buyer) {
		confirmed, err := call(reservation+"/confirm", map[string]string{"user": user})
		if confirmed.Outcome == "already_confirmed" {
			return "confirmed", err
		}
		return confirmed.Outcome, err
	}
	cancelled, err := call(reservation+"/cancel", map[string]string{"user": user})
	if cancelled.Outcome == "already_cancelled" {
		return "cancelled", err
	}
	return cancelled.Outcome, err
}

func main() {
	buyers, err := strconv.Atoi(env("BUYERS", "10"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "BUYERS:", err)
		os.Exit(2)
	}
	var (
		mu       sync.Mutex
		outcomes = map[string]int{}
		failed   error
		wg       sync.WaitGroup
	)
	for i := 0; i < buyers; i++ {
		i := i
		wg.Add(1)
		go func() {
			defer wg.Done()
			outcome, err := checkout(i)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed = err
				return
			}
			outcomes[outcome]++
		}()
	}
	wg.Wait()
	if failed != nil {
		fmt.Fprintln(os.Stderr, "checkout:", failed)
		os.Exit(1)
	}
	out, _ := json.Marshal(map[string]any{"client": "go", "outcomes": outcomes})
	fmt.Println(string(out))
}
