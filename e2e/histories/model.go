package histories

// The sequential specification of one drop (docs/design.md's answers table and
// invariants) as a Porcupine model, and the translation of a recorded history into
// Porcupine operations.
//
// State: the stock (remaining, unclamped: a cut below what is held makes it
// negative), the limit, whether the window is closed (endsAt moved into the past),
// each key's reservation (nothing, pending, active, confirmed, cancelled, with its
// buyer and quantity), each buyer's held units (pending + active + confirmed count
// against perUserLimit), and each ambiguous attempt's progress.
//
// Holds are 3600 s long: nothing expires inside a history, so the model has no
// expiry and an `expired` answer is always wrong here.
//
// Ambiguous answers:
//   - A reserve answered 503 (throttled, unavailable) may have been admitted and
//     taken back inside its own interval (the gate admits first, then undoes the
//     admission when no permit is free or the ledger refuses), and others may see
//     that meanwhile. It becomes two operations over the same interval: `admit?`
//     (admits if the reserve could be admitted at that point, as pending) and
//     `undo` (takes a pending admission of this attempt back; before `admit?` it
//     closes the attempt, so a later `admit?` does nothing).
//   - A reserve with no answer (a timeout, a reset connection: its sidecar was
//     killed) may take effect or not, at any time after its call: `admit?` and two
//     resolutions, `drop` (take it back) and `keep` (it becomes an active
//     reservation, as when its ledger commit landed), all three with no return
//     time. Whichever resolution comes first decides; the other does nothing.
//     Until then the admission is pending: it holds its units, its key answers
//     not_found to look-ups, confirms and cancels, 422 to another buyer, and a
//     retry of the same buyer hears already_reserved once it is kept or, once it
//     is dropped, is decided afresh (201, or a refusal if the sale has ended, been
//     cut or sold out meanwhile): a retry never completes it.
//   - A confirm or cancel answered 503 changed nothing (docs/design.md: a request that
//     answers an error changed nothing): one operation that must leave the state
//     as it is. One with no answer is two operations with no return time, `do`
//     (the confirm or cancel, where it applies) and `skip`; the first decides.
//   - A look-up or the drop's GET answered 503 or not answered says nothing and
//     changes nothing: left out of the history.
//   - A 404 that names the drop as unknown (Redis lost the drop's config and the
//     operator has not published it again yet) is treated like a 503.

import (
	"fmt"
	"math"
	"sort"
	"strings"

	"github.com/anishathalye/porcupine"
)

// Reservation states in the model.
const (
	stNone byte = iota
	stPending
	stActive
	stConfirmed
	stCancelled
	stOther // a state word the model does not know (expired, ...): never right
)

func stateByte(s string) byte {
	switch s {
	case "pending":
		return stPending
	case "active":
		return stActive
	case "confirmed":
		return stConfirmed
	case "cancelled":
		return stCancelled
	}
	return stOther
}

var stateNames = [...]string{"none", "pending", "active", "confirmed", "cancelled", "other"}

// Attempt progress (one byte per ambiguous attempt).
const (
	attOpen    byte = iota // nothing decided yet
	attPending             // admitted, pending, not resolved
	attClosed              // resolved: nothing more happens
)

// mOp is a model operation.
type mOp uint8

const (
	opReserve mOp = iota
	opAdmit       // `admit?` of an ambiguous reserve
	opUndo        // `undo` of a 503 reserve, `drop` of an unanswered one
	opKeep        // `keep` of an unanswered reserve
	opConfirm
	opCancel
	opSkip // `skip` of an unanswered confirm or cancel
	opLookup
	opShow
	opLimit  // apply: limitedQuantity
	opWindow // apply: endsAt moved (ended or open)
	opNoop   // apply: kill switch, reconcile after a Redis loss
)

var opNames = [...]string{"reserve", "admit?", "undo", "keep", "confirm", "cancel", "skip", "lookup", "show", "limit", "window", "apply"}

// mIn is an operation's input.
type mIn struct {
	op      mOp
	key     int
	user    int
	qty     int
	att     int // attempt index, for ambiguous operations
	limit   int // opLimit: the new limitedQuantity, or variant's quantity
	variant int // opLimit: the variant changed (-1: the drop's limitedQuantity)
	ended   bool
	// do: the attempt's operation is the confirm or cancel (opSkip's partner).
	do  mOp
	rec *call // what was recorded, for descriptions
}

// Answer kinds in the model.
const (
	outDefinite = iota // an answer that says what happened
	outFailed          // 503 / unknown drop: nothing changed
	outNone            // no answer, or an operation of the model's own
)

// mOut is an operation's output.
type mOut struct {
	kind      int
	outcome   string
	state     byte
	user      int // -1: no user in the answer; -2: a user the history never used
	qty       int // 0: none in the answer
	remaining int // -1: none in the answer
	variant   int // the variant the answer names: -1 none, -2 one the drop does not have
	vleft     []int
}

// mState is the model's state. Its byte arrays are split in chunks shared between
// states, so that a step copies one chunk, not every key: the checker keeps every
// state it has seen.
type mState struct {
	stock int
	limit int
	// Per variant (a drop with variants): what it has left, and its quantity.
	vstock [maxVariants]int
	vlimit [maxVariants]int
	ended  bool
	res    store  // 3 bytes per key: state, user, quantity
	held   store  // 1 byte per user
	att    store  // 1 byte per attempt
	zh     uint64 // the hash of res, held and att (kept up to date by each change)
}

// maxVariants bounds a history's variants (the model keeps them in arrays).
const maxVariants = 4

func (s mState) equal(o mState) bool {
	return s.stock == o.stock && s.limit == o.limit && s.ended == o.ended && s.zh == o.zh &&
		s.vstock == o.vstock && s.vlimit == o.vlimit &&
		s.res.equal(o.res) && s.held.equal(o.held) && s.att.equal(o.att)
}

const chunkSize = 192

type chunk [chunkSize]byte

// store is an immutable byte array in chunks; a change copies only its chunk.
type store struct{ parts []*chunk }

func newStore(n int) store {
	s := store{parts: make([]*chunk, (n+chunkSize-1)/chunkSize)}
	zero := new(chunk)
	for i := range s.parts {
		s.parts[i] = zero
	}
	return s
}

func (s store) get(i int) byte { return s.parts[i/chunkSize][i%chunkSize] }

// with returns the store with bytes i.. set to values (all in one chunk).
func (s store) with(i int, values ...byte) store {
	parts := append([]*chunk(nil), s.parts...)
	c := *parts[i/chunkSize]
	copy(c[i%chunkSize:], values)
	parts[i/chunkSize] = &c
	return store{parts: parts}
}

func (s store) equal(o store) bool {
	for i := range s.parts {
		if s.parts[i] != o.parts[i] && *s.parts[i] != *o.parts[i] {
			return false
		}
	}
	return true
}

// spec is what a history's model knows beforehand.
type spec struct {
	limit      int
	perUser    int
	keys       []string
	users      []string
	attKey     []int // per attempt: its key
	keyAtts    [][]int
	initEnded  bool
	attemptOps []mOp // per attempt: what it is (opReserve, opConfirm, opCancel)
	// A drop with variants: their quantities, and each key's variant (-1 none).
	variants   []int
	keyVariant []int
}

// variantOf is key k's variant (-1 for a drop without variants).
func (sp *spec) variantOf(k int) int {
	if len(sp.variants) == 0 || k < 0 || k >= len(sp.keyVariant) {
		return -1
	}
	return sp.keyVariant[k]
}

// sameVariant: an answer about key k names k's variant, or none.
func (sp *spec) sameVariant(out mOut, k int) bool {
	return len(sp.variants) == 0 || out.variant == -1 || out.variant == sp.variantOf(k)
}

func (sp *spec) model() porcupine.Model {
	return porcupine.Model{
		Init: func() any {
			var quantities [maxVariants]int
			copy(quantities[:], sp.variants)
			return mState{
				stock:  sp.limit,
				limit:  sp.limit,
				vstock: quantities,
				vlimit: quantities,
				ended:  sp.initEnded,
				res:    newStore(3 * len(sp.keys)),
				held:   newStore(len(sp.users)),
				att:    newStore(len(sp.attKey)),
			}
		},
		Step: func(state, input, output any) (bool, any) {
			return sp.step(state.(mState), input.(mIn), output.(mOut))
		},
		Equal: func(a, b any) bool { return a.(mState).equal(b.(mState)) },
		Hash: func(state any) uint64 {
			s := state.(mState)
			ended := 0
			if s.ended {
				ended = 1
			}
			h := s.zh ^ mix(3, ended, byte(s.stock+128)) ^ mix(4, 0, byte(s.limit))*31
			for i := range sp.variants {
				h ^= mix(5, i, byte(s.vstock[i]+128)) ^ mix(6, i, byte(s.vlimit[i]))
			}
			return h
		},
		DescribeOperation: func(input, output any) string {
			return sp.describe(input.(mIn), output.(mOut))
		},
		DescribeState: func(state any) string { return sp.describeState(state.(mState)) },
	}
}

// reservation is key k's: its state, buyer and quantity.
func (s mState) reservation(k int) (st byte, user int, qty int) {
	c := s.res.parts[3*k/chunkSize]
	i := 3 * k % chunkSize
	return c[i], int(c[i+1]), int(c[i+2])
}

// mix is one byte's share of the state's hash (zero for a zero byte, so that the
// initial state hashes to 0 whatever its size).
func mix(region, index int, value byte) uint64 {
	if value == 0 {
		return 0
	}
	x := uint64(region)<<48 ^ uint64(index)<<8 ^ uint64(value)
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

func (s mState) withRes(k int, st byte, user, qty int) mState {
	old0, old1, old2 := s.reservation(k)
	for i, pair := range [3][2]byte{{old0, st}, {byte(old1), byte(user)}, {byte(old2), byte(qty)}} {
		s.zh ^= mix(0, 3*k+i, pair[0]) ^ mix(0, 3*k+i, pair[1])
	}
	s.res = s.res.with(3*k, st, byte(user), byte(qty))
	return s
}

func (s mState) withHeld(user, delta int) mState {
	old := s.held.get(user)
	v := byte(int(old) + delta)
	s.zh ^= mix(1, user, old) ^ mix(1, user, v)
	s.held = s.held.with(user, v)
	return s
}

func (s mState) withAtt(a int, v byte) mState {
	old := s.att.get(a)
	if old == v {
		return s
	}
	s.zh ^= mix(2, a, old) ^ mix(2, a, v)
	s.att = s.att.with(a, v)
	return s
}

// admissible: a new reservation of qty for user fits the window, the buyer's limit
// and the stock.
func (sp *spec) admissible(s mState, k, user, qty int) bool {
	return !s.ended && int(s.held.get(user))+qty <= sp.perUser && s.stock >= qty && sp.inStock(s, k, qty)
}

// inStock: key k's variant (if any) has qty left.
func (sp *spec) inStock(s mState, k, qty int) bool {
	v := sp.variantOf(k)
	return v < 0 || s.vstock[v] >= qty
}

// admit makes key k a reservation in state st, taking its units.
func (sp *spec) admit(s mState, k, user, qty int, st byte) mState {
	s = s.withRes(k, st, user, qty)
	s = s.withHeld(user, qty)
	s.stock -= qty
	if v := sp.variantOf(k); v >= 0 {
		s.vstock[v] -= qty
	}
	return s
}

// giveBack returns key k's units and marks it st (none for a take-back, cancelled).
func (sp *spec) giveBack(s mState, k int, st byte) mState {
	_, user, qty := s.reservation(k)
	s = s.withRes(k, st, user, qty)
	if st == stNone {
		s = s.withRes(k, stNone, 0, 0)
	}
	s = s.withHeld(user, -qty)
	s.stock += qty
	if v := sp.variantOf(k); v >= 0 {
		s.vstock[v] += qty
	}
	return s
}

// activate turns key k's pending admission into an active reservation (its
// commit landed): every attempt pending on it is resolved.
func (sp *spec) activate(s mState, k int) mState {
	_, user, qty := s.reservation(k)
	s = s.withRes(k, stActive, user, qty)
	for _, a := range sp.keyAtts[k] {
		if s.att.get(a) == attPending {
			s = s.withAtt(a, attClosed)
		}
	}
	return s
}

// matches: an answer that shows a reservation shows key k's buyer and quantity.
func matches(out mOut, user, qty int) bool {
	if out.user != -1 && out.user != user {
		return false
	}
	if out.qty != 0 && out.qty != qty {
		return false
	}
	return true
}

func (sp *spec) step(s mState, in mIn, out mOut) (bool, any) {
	switch in.op {
	case opReserve:
		return sp.reserve(s, in, out)
	case opAdmit:
		if s.att.get(in.att) != attOpen {
			return true, s
		}
		st, _, _ := s.reservation(in.key)
		if st != stNone || !sp.admissible(s, in.key, in.user, in.qty) {
			return true, s.withAtt(in.att, attClosed)
		}
		s = sp.admit(s, in.key, in.user, in.qty, stPending)
		return true, s.withAtt(in.att, attPending)
	case opUndo:
		switch s.att.get(in.att) {
		case attOpen:
			return true, s.withAtt(in.att, attClosed)
		case attPending:
			return true, sp.giveBack(s, in.key, stNone).withAtt(in.att, attClosed)
		}
		return true, s
	case opKeep:
		switch s.att.get(in.att) {
		case attOpen:
			return true, s.withAtt(in.att, attClosed)
		case attPending:
			return true, sp.activate(s, in.key)
		}
		return true, s
	case opSkip:
		if s.att.get(in.att) == attOpen {
			return true, s.withAtt(in.att, attClosed)
		}
		return true, s
	case opConfirm, opCancel:
		if in.att >= 0 {
			// The `do` of an unanswered confirm or cancel: first of its pair.
			if s.att.get(in.att) != attOpen {
				return true, s
			}
			s = s.withAtt(in.att, attClosed)
			st, _, _ := s.reservation(in.key)
			if in.op == opConfirm && st == stActive {
				_, u, q := s.reservation(in.key)
				s = s.withRes(in.key, stConfirmed, u, q)
			} else if in.op == opCancel && (st == stActive || st == stConfirmed) {
				s = sp.giveBack(s, in.key, stCancelled)
			}
			return true, s
		}
		if out.kind == outFailed {
			return true, s
		}
		if in.op == opConfirm {
			return sp.confirm(s, in, out)
		}
		return sp.cancel(s, in, out)
	case opLookup:
		st, u, q := s.reservation(in.key)
		switch out.outcome {
		case "found":
			return (st == stActive || st == stConfirmed || st == stCancelled) && out.state == st && matches(out, u, q) && sp.sameVariant(out, in.key), s
		case "not_found":
			return st == stNone || st == stPending, s
		}
		return false, s
	case opShow:
		if out.outcome != "found" || out.remaining != max(0, s.stock) || len(out.vleft) != len(sp.variants) {
			return false, s
		}
		for i, left := range out.vleft {
			// A variant shows no more than the drop as a whole has left.
			if left != max(0, min(s.vstock[i], s.stock)) {
				return false, s
			}
		}
		return true, s
	case opLimit:
		if v := in.variant; v >= 0 && len(sp.variants) > 0 {
			by := in.limit - s.vlimit[v]
			s.vstock[v] += by
			s.vlimit[v] = in.limit
			s.stock += by
			s.limit += by
			return true, s
		}
		s.stock += in.limit - s.limit
		s.limit = in.limit
		return true, s
	case opWindow:
		s.ended = in.ended
		return true, s
	case opNoop:
		return true, s
	}
	return false, s
}

func (sp *spec) reserve(s mState, in mIn, out mOut) (bool, any) {
	k := in.key
	st, u, q := s.reservation(k)
	same := st != stNone && u == in.user && q == in.qty
	switch out.outcome {
	case "admitted":
		if !sp.sameVariant(out, k) {
			return false, s
		}
		if st == stNone {
			if !sp.admissible(s, k, in.user, in.qty) {
				return false, s
			}
			return true, sp.admit(s, k, in.user, in.qty, stActive)
		}
		// A 201 is always a fresh admission: a retry never completes an earlier
		// attempt's pending admission (past its bound that attempt is resolved,
		// its `drop` or `keep` first, and the retry decided on the sale as it is).
		return false, s
	case "already_reserved":
		if !same || !matches(out, u, q) || !sp.sameVariant(out, k) {
			return false, s
		}
		if st == stPending {
			return out.state == stActive, sp.activate(s, k)
		}
		return out.state == st, s
	case "idempotency_key_reused":
		return st != stNone && !same, s
	case "ended":
		return st == stNone && s.ended, s
	case "per_user_limit_exceeded":
		return st == stNone && !s.ended && int(s.held.get(in.user))+in.qty > sp.perUser, s
	case "sold_out":
		return st == stNone && !s.ended && int(s.held.get(in.user))+in.qty <= sp.perUser &&
			(s.stock < in.qty || !sp.inStock(s, k, in.qty)), s
	}
	return false, s
}

func (sp *spec) confirm(s mState, in mIn, out mOut) (bool, any) {
	st, u, q := s.reservation(in.key)
	switch out.outcome {
	case "confirmed":
		if st != stActive || !matches(out, u, q) {
			return false, s
		}
		return true, s.withRes(in.key, stConfirmed, u, q)
	case "already_confirmed":
		return st == stConfirmed && matches(out, u, q), s
	case "cancelled":
		return st == stCancelled && matches(out, u, q), s
	case "not_found":
		return st == stNone || st == stPending, s
	}
	return false, s
}

func (sp *spec) cancel(s mState, in mIn, out mOut) (bool, any) {
	st, u, q := s.reservation(in.key)
	switch out.outcome {
	case "cancelled":
		if (st != stActive && st != stConfirmed) || !matches(out, u, q) {
			return false, s
		}
		return true, sp.giveBack(s, in.key, stCancelled)
	case "already_cancelled":
		return st == stCancelled && matches(out, u, q), s
	case "not_found":
		return st == stNone || st == stPending, s
	}
	return false, s
}

func (sp *spec) describe(in mIn, out mOut) string {
	var b strings.Builder
	switch in.op {
	case opLimit:
		if in.variant >= 0 && len(sp.variants) > 0 {
			fmt.Fprintf(&b, "apply %s quantity=%d", variantName(in.variant), in.limit)
		} else {
			fmt.Fprintf(&b, "apply limitedQuantity=%d", in.limit)
		}
	case opWindow:
		if in.ended {
			b.WriteString("apply endsAt in the past")
		} else {
			b.WriteString("apply endsAt in the future")
		}
	case opNoop:
		if in.rec != nil {
			fmt.Fprintf(&b, "apply %s", in.rec.Apply.What)
		} else {
			b.WriteString("apply")
		}
	default:
		b.WriteString(opNames[in.op])
		if in.op == opSkip {
			fmt.Fprintf(&b, " (%s)", opNames[in.do])
		}
		if in.op != opShow {
			fmt.Fprintf(&b, " %s", sp.keys[in.key])
		}
		if in.op == opReserve || in.op == opAdmit {
			fmt.Fprintf(&b, " %s x%d", sp.users[in.user], in.qty)
		}
		if in.att >= 0 {
			fmt.Fprintf(&b, " #%d", in.att)
		}
	}
	if in.rec != nil && in.rec.Kind != kApply {
		fmt.Fprintf(&b, " @s%d", in.rec.Sidecar)
	}
	switch out.kind {
	case outDefinite:
		fmt.Fprintf(&b, " -> %s", out.outcome)
		if out.state != stNone {
			fmt.Fprintf(&b, " [%s]", stateNames[out.state])
		}
		if out.remaining >= 0 {
			fmt.Fprintf(&b, " remaining=%d", out.remaining)
		}
	case outFailed:
		if in.rec != nil {
			fmt.Fprintf(&b, " -> %d %s", in.rec.Ans.Status, in.rec.Ans.Outcome)
		} else {
			b.WriteString(" -> failed")
		}
	case outNone:
		if in.rec != nil && in.rec.Ans.Kind == ansUnknown {
			fmt.Fprintf(&b, " -> no answer (%s)", in.rec.Ans.Err)
		}
	}
	return b.String()
}

func (sp *spec) describeState(s mState) string {
	counts := make([]int, len(stateNames))
	var pending []string
	for k := range sp.keys {
		st, _, _ := s.reservation(k)
		counts[st]++
		if st == stPending {
			pending = append(pending, sp.keys[k])
		}
	}
	window := "open"
	if s.ended {
		window = "ended"
	}
	desc := fmt.Sprintf("stock %d, limit %d, %s; active %d, confirmed %d, cancelled %d",
		s.stock, s.limit, window, counts[stActive], counts[stConfirmed], counts[stCancelled])
	for i := range sp.variants {
		desc += fmt.Sprintf("; %s %d of %d", variantName(i), s.vstock[i], s.vlimit[i])
	}
	if len(pending) > 0 {
		desc += "; pending " + strings.Join(pending, " ")
	}
	return desc
}

// describeKeys is the state of the given keys and their buyers, for a report.
func (sp *spec) describeKeys(s mState, keys []int) string {
	var parts []string
	seen := map[int]bool{}
	for _, k := range keys {
		if k < 0 || seen[k] {
			continue
		}
		seen[k] = true
		st, u, q := s.reservation(k)
		if st == stNone {
			parts = append(parts, fmt.Sprintf("%s: none", sp.keys[k]))
			continue
		}
		parts = append(parts, fmt.Sprintf("%s: %s %s x%d (%s holds %d)", sp.keys[k], stateNames[st], sp.users[u], q, sp.users[u], s.held.get(u)))
	}
	return strings.Join(parts, "; ")
}

// keyInFlight is what a 503 throttled says when the key's earlier attempt is
// still pending: this attempt was not admitted.
const keyInFlight = "an earlier attempt with this key is unresolved"

// impossible: an answer the model refuses in every state (a word outside the
// answers table, a state the model does not have, such as expired).
func impossible(c *call) bool {
	a := c.Ans
	if a.Kind != ansDefinite {
		return false
	}
	known := func(words ...string) bool {
		for _, w := range words {
			if a.Outcome == w {
				return true
			}
		}
		return false
	}
	held := a.State == "active" || a.State == "confirmed" || a.State == "cancelled"
	switch c.Kind {
	case kReserve:
		return !known("admitted", "already_reserved", "idempotency_key_reused", "ended", "per_user_limit_exceeded", "sold_out") ||
			(a.Outcome == "already_reserved" && !held)
	case kConfirm:
		return !known("confirmed", "already_confirmed", "cancelled", "not_found")
	case kCancel:
		return !known("cancelled", "already_cancelled", "not_found")
	case kLookup:
		return !known("found", "not_found") || (a.Outcome == "found" && !held)
	case kShow:
		return a.Outcome != "found"
	}
	return false
}

// unbounded is the return time of operations that may take effect at any time
// after their call: after every recorded return.
const unbounded = math.MaxInt64 / 2

// translate turns a recorded history into the model's spec and Porcupine
// operations. Calls whose answer says nothing (a look-up answered 503) are left out.
func translate(calls []*call, limit int, variants []int, perUser int, ended bool, clients int) (*spec, []porcupine.Operation) {
	sp := &spec{limit: limit, perUser: perUser, initEnded: ended, variants: variants}
	keyIdx := map[string]int{}
	userIdx := map[string]int{}
	keyOf := func(k string) int {
		if i, ok := keyIdx[k]; ok {
			return i
		}
		keyIdx[k] = len(sp.keys)
		sp.keys = append(sp.keys, k)
		sp.keyAtts = append(sp.keyAtts, nil)
		sp.keyVariant = append(sp.keyVariant, -1)
		return keyIdx[k]
	}
	userOf := func(u string) int {
		if i, ok := userIdx[u]; ok {
			return i
		}
		userIdx[u] = len(sp.users)
		sp.users = append(sp.users, u)
		return userIdx[u]
	}
	for _, c := range calls {
		if c.Key != "" {
			k := keyOf(c.Key)
			if c.Kind == kReserve && len(variants) > 0 {
				sp.keyVariant[k] = c.Variant
			}
		}
		if c.User != "" {
			userOf(c.User)
		}
	}
	newAtt := func(k int, op mOp) int {
		a := len(sp.attKey)
		sp.attKey = append(sp.attKey, k)
		sp.attemptOps = append(sp.attemptOps, op)
		sp.keyAtts[k] = append(sp.keyAtts[k], a)
		return a
	}
	answerUser := func(u string) int {
		if u == "" {
			return -1
		}
		if i, ok := userIdx[u]; ok {
			return i
		}
		return -2
	}
	var ops []porcupine.Operation
	var lastUnbounded int64 = unbounded
	add := func(c *call, client int, in mIn, out mOut, ret int64) {
		if ret == unbounded {
			// Distinct return times keep the visualization's order readable.
			lastUnbounded++
			ret = lastUnbounded
		}
		ops = append(ops, porcupine.Operation{ClientId: client, Input: in, Call: c.Invoke, Output: out, Return: ret})
	}
	sort.SliceStable(calls, func(i, j int) bool { return calls[i].Invoke < calls[j].Invoke })
	for _, c := range calls {
		in := mIn{key: -1, user: -1, att: -1, rec: c}
		if c.Key != "" {
			in.key = keyIdx[c.Key]
		}
		if c.User != "" {
			in.user = userIdx[c.User]
		}
		in.qty = c.Qty
		out := mOut{kind: outDefinite, outcome: c.Ans.Outcome, user: answerUser(c.Ans.User), qty: c.Ans.Qty, remaining: -1, variant: -1}
		if c.Ans.Variant != "" {
			out.variant = -2
			for i := range variants {
				if c.Ans.Variant == variantName(i) {
					out.variant = i
				}
			}
		}
		if c.Ans.State != "" {
			out.state = stateByte(c.Ans.State)
		}
		ghost := clients + c.Client // a second row for the partner operations
		failed := c.Ans.Kind == ansFailed
		unknown := c.Ans.Kind == ansUnknown
		switch c.Kind {
		case kReserve:
			if failed && strings.Contains(c.Ans.Message, keyInFlight) {
				// The gate found the key's earlier attempt pending and changed
				// nothing (docs/design.md: "an earlier attempt is unresolved"): no
				// admission of its own, so nothing to model.
				continue
			}
			if failed || unknown {
				in.att = newAtt(in.key, opReserve)
				admit := in
				admit.op = opAdmit
				ret := c.Return
				if unknown {
					ret = unbounded
				}
				add(c, c.Client, admit, mOut{kind: outNone}, ret)
				undo := in
				undo.op = opUndo
				if failed {
					add(c, ghost, undo, mOut{kind: outNone}, c.Return)
				} else {
					add(c, ghost, undo, mOut{kind: outNone}, unbounded)
					keep := in
					keep.op = opKeep
					add(c, ghost, keep, mOut{kind: outNone}, unbounded)
				}
				continue
			}
			in.op = opReserve
			add(c, c.Client, in, out, c.Return)
		case kConfirm, kCancel:
			in.op = opConfirm
			if c.Kind == kCancel {
				in.op = opCancel
			}
			if unknown {
				in.att = newAtt(in.key, in.op)
				add(c, c.Client, in, mOut{kind: outNone}, unbounded)
				skip := in
				skip.op, skip.do = opSkip, in.op
				add(c, ghost, skip, mOut{kind: outNone}, unbounded)
				continue
			}
			if failed {
				out = mOut{kind: outFailed, user: -1, remaining: -1}
			}
			add(c, c.Client, in, out, c.Return)
		case kLookup:
			if failed || unknown {
				continue
			}
			in.op = opLookup
			add(c, c.Client, in, out, c.Return)
		case kShow:
			if failed || unknown {
				continue
			}
			in.op = opShow
			out.remaining = c.Ans.Remaining
			out.vleft = c.Ans.Variants
			add(c, c.Client, in, out, c.Return)
		case kApply:
			switch c.Apply.What {
			case "limit":
				in.op, in.limit, in.variant = opLimit, c.Apply.Limit, c.Apply.Variant
			case "ends":
				in.op, in.ended = opWindow, c.Apply.Ended
			default:
				in.op = opNoop
			}
			ret := c.Return
			if c.Ans.Kind != ansDefinite {
				ret = unbounded
			}
			add(c, c.Client, in, mOut{kind: outNone}, ret)
		}
	}
	return sp, ops
}

// pureRead: an operation that changes no state whatever the state is (it is
// accepted or refused, nothing more). Leaving one out of a linearizable history
// leaves it linearizable, so a failing history stripped of some of them still
// proves the failure.
func pureRead(op porcupine.Operation) bool {
	in, out := op.Input.(mIn), op.Output.(mOut)
	switch in.op {
	case opLookup, opShow:
		return true
	case opReserve:
		switch out.outcome {
		case "sold_out", "per_user_limit_exceeded", "ended", "idempotency_key_reused":
			return true
		case "already_reserved":
			// Only one that says active may complete a pending admission.
			return out.state != stActive
		}
	case opConfirm, opCancel:
		if in.att >= 0 {
			return false
		}
		if out.kind == outFailed {
			return true
		}
		switch out.outcome {
		case "already_confirmed", "already_cancelled", "not_found":
			return true
		case "cancelled":
			return in.op == opConfirm
		}
	}
	return false
}
