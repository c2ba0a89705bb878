package histories

import (
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

// The model on small hand-written histories: what it must accept and refuse.

type hc struct {
	kind           callKind
	client         int
	key, user      string
	qty            int
	from, to       int64 // ms; to < 0: no answer
	status         int
	outcome, state string
	remaining      int
	apply          applyChange
	variant        int // a reserve's variant (read only by checkVariants)
}

func history(cs ...hc) []*call {
	var calls []*call
	for _, h := range cs {
		c := &call{Kind: h.kind, Client: h.client, Key: h.key, User: h.user, Qty: h.qty, Apply: h.apply,
			Variant: h.variant, Invoke: h.from * 1e6, Return: h.to * 1e6}
		c.Ans = answer{Kind: ansDefinite, Status: h.status, Outcome: h.outcome, State: h.state, Remaining: -1}
		if h.kind == kShow || h.remaining != 0 {
			c.Ans.Remaining = h.remaining
		}
		switch {
		case h.to < 0:
			c.Return = c.Invoke + 1
			c.Ans = answer{Kind: ansUnknown, Err: "reset", Remaining: -1}
		case h.status == 503:
			c.Ans.Kind = ansFailed
		}
		calls = append(calls, c)
	}
	return calls
}

func checkModel(t *testing.T, limit int, calls []*call) porcupine.CheckResult {
	t.Helper()
	sp, ops := translate(calls, limit, nil, 2, false, 4)
	return porcupine.CheckOperationsTimeout(sp.model(), ops, 10*time.Second)
}

func TestModelAcceptsSequentialSale(t *testing.T) {
	calls := history(
		hc{kind: kReserve, key: "a", user: "u1", qty: 1, from: 0, to: 1, status: 201, outcome: "admitted", state: "active"},
		hc{kind: kReserve, key: "a", user: "u1", qty: 1, from: 2, to: 3, status: 200, outcome: "already_reserved", state: "active"},
		hc{kind: kReserve, key: "a", user: "u2", qty: 1, from: 2, to: 3, status: 422, outcome: "idempotency_key_reused"},
		hc{kind: kReserve, key: "b", user: "u2", qty: 1, from: 4, to: 5, status: 409, outcome: "sold_out"},
		hc{kind: kConfirm, key: "a", from: 6, to: 7, status: 200, outcome: "confirmed", state: "confirmed"},
		hc{kind: kConfirm, key: "a", from: 8, to: 9, status: 200, outcome: "already_confirmed", state: "confirmed"},
		hc{kind: kCancel, key: "a", from: 10, to: 11, status: 200, outcome: "cancelled", state: "cancelled"},
		hc{kind: kCancel, key: "a", from: 12, to: 13, status: 200, outcome: "already_cancelled", state: "cancelled"},
		hc{kind: kConfirm, key: "a", from: 14, to: 15, status: 409, outcome: "cancelled", state: "cancelled"},
		hc{kind: kShow, from: 16, to: 17, status: 200, outcome: "found", remaining: 1},
		hc{kind: kLookup, key: "zz", from: 18, to: 19, status: 404, outcome: "not_found"},
		hc{kind: kReserve, key: "c", user: "u1", qty: 2, from: 20, to: 21, status: 409, outcome: "sold_out"},
	)
	if r := checkModel(t, 1, calls); r != porcupine.Ok {
		t.Fatalf("a sequential sale is refused: %s", r)
	}
}

func TestModelRefusesSoldOutWithStockFree(t *testing.T) {
	calls := history(
		hc{kind: kReserve, key: "a", user: "u1", qty: 1, from: 0, to: 1, status: 201, outcome: "admitted"},
		hc{kind: kReserve, key: "b", user: "u2", qty: 1, from: 2, to: 3, status: 409, outcome: "sold_out"},
	)
	if r := checkModel(t, 2, calls); r != porcupine.Illegal {
		t.Fatalf("sold_out with a unit free and nothing in flight: %s", r)
	}
}

func TestModel503ReserveMayHoldInsideItsInterval(t *testing.T) {
	// The 503 reserve of the last unit held it while b was refused, then took it
	// back: c gets it afterwards.
	calls := history(
		hc{kind: kReserve, key: "a", user: "u1", qty: 1, from: 0, to: 10, status: 503, outcome: "throttled"},
		hc{kind: kReserve, key: "b", user: "u2", qty: 1, from: 2, to: 3, status: 409, outcome: "sold_out"},
		hc{kind: kShow, from: 4, to: 5, status: 200, outcome: "found", remaining: 0},
		hc{kind: kShow, from: 11, to: 12, status: 200, outcome: "found", remaining: 1},
		hc{kind: kReserve, key: "c", user: "u2", qty: 1, from: 13, to: 14, status: 201, outcome: "admitted"},
	)
	if r := checkModel(t, 1, calls); r != porcupine.Ok {
		t.Fatalf("a 503 reserve's admission and undo inside its interval: %s", r)
	}
	// But not after it answered.
	calls = history(
		hc{kind: kReserve, key: "a", user: "u1", qty: 1, from: 0, to: 10, status: 503, outcome: "throttled"},
		hc{kind: kShow, from: 11, to: 12, status: 200, outcome: "found", remaining: 0},
	)
	if r := checkModel(t, 1, calls); r != porcupine.Illegal {
		t.Fatalf("a 503 reserve that still holds its unit after its answer: %s", r)
	}
}

func TestModelRefusesEffectOf503Cancel(t *testing.T) {
	calls := history(
		hc{kind: kReserve, key: "a", user: "u1", qty: 1, from: 0, to: 1, status: 201, outcome: "admitted"},
		hc{kind: kCancel, key: "a", from: 2, to: 3, status: 503, outcome: "unavailable"},
		hc{kind: kLookup, key: "a", from: 4, to: 5, status: 200, outcome: "found", state: "cancelled"},
	)
	if r := checkModel(t, 1, calls); r != porcupine.Illegal {
		t.Fatalf("a 503 cancel that took effect: %s", r)
	}
	calls[1].Ans = answer{Kind: ansUnknown, Err: "reset", Remaining: -1}
	if r := checkModel(t, 1, calls); r != porcupine.Ok {
		t.Fatalf("an unanswered cancel that took effect: %s", r)
	}
}

func TestModelUnansweredReserve(t *testing.T) {
	// No answer: it may have been admitted (then taken back and the retry admitted
	// afresh) ...
	calls := history(
		hc{kind: kReserve, key: "a", user: "u1", qty: 1, from: 0, to: -1},
		hc{kind: kLookup, key: "a", from: 2, to: 3, status: 404, outcome: "not_found"},
		hc{kind: kShow, from: 4, to: 5, status: 200, outcome: "found", remaining: 0},
		hc{kind: kReserve, key: "a", user: "u1", qty: 1, from: 6, to: 7, status: 201, outcome: "admitted"},
		hc{kind: kLookup, key: "a", from: 8, to: 9, status: 200, outcome: "found", state: "active"},
	)
	if r := checkModel(t, 1, calls); r != porcupine.Ok {
		t.Fatalf("an unanswered reserve completed by its retry: %s", r)
	}
	// ... or taken back, but not both.
	calls = history(
		hc{kind: kReserve, key: "a", user: "u1", qty: 1, from: 0, to: -1},
		hc{kind: kLookup, key: "a", from: 2, to: 3, status: 200, outcome: "found", state: "active"},
		hc{kind: kShow, from: 4, to: 5, status: 200, outcome: "found", remaining: 1},
	)
	if r := checkModel(t, 1, calls); r != porcupine.Illegal {
		t.Fatalf("a reservation that is found and whose unit is back: %s", r)
	}
	// A retry is decided on the sale as it is: after the end, never admitted
	// (taking over the pending admission, with the unit it held, would be).
	calls = history(
		hc{kind: kReserve, key: "a", user: "u1", qty: 1, from: 0, to: -1},
		hc{kind: kShow, from: 2, to: 3, status: 200, outcome: "found", remaining: 0},
		hc{kind: kApply, client: 3, from: 4, to: 5, apply: applyChange{What: "ends", Ended: true}},
		hc{kind: kReserve, key: "a", user: "u1", qty: 1, from: 6, to: 7, status: 201, outcome: "admitted"},
	)
	if r := checkModel(t, 1, calls); r != porcupine.Illegal {
		t.Fatalf("a retry admitted after the end on its dead attempt's unit: %s", r)
	}
}

func TestModelLimitCutAndWindow(t *testing.T) {
	calls := history(
		hc{kind: kReserve, key: "a", user: "u1", qty: 2, from: 0, to: 1, status: 201, outcome: "admitted"},
		hc{kind: kApply, client: 3, from: 2, to: 3, apply: applyChange{What: "limit", Limit: 1}},
		hc{kind: kShow, from: 4, to: 5, status: 200, outcome: "found", remaining: 0},
		hc{kind: kCancel, key: "a", from: 6, to: 7, status: 200, outcome: "cancelled"},
		hc{kind: kShow, from: 8, to: 9, status: 200, outcome: "found", remaining: 1},
		hc{kind: kApply, client: 3, from: 10, to: 11, apply: applyChange{What: "ends", Ended: true}},
		hc{kind: kReserve, key: "b", user: "u2", qty: 1, from: 12, to: 13, status: 403, outcome: "ended"},
	)
	if r := checkModel(t, 3, calls); r != porcupine.Ok {
		t.Fatalf("a cut below what is held, paid back, then the end: %s", r)
	}
	calls[6].Ans.Outcome, calls[6].Ans.Status = "admitted", 201
	if r := checkModel(t, 3, calls); r != porcupine.Illegal {
		t.Fatalf("an admission after the end: %s", r)
	}
}

// checkVariants checks calls against a drop in sizes of these quantities.
func checkVariants(t *testing.T, calls []*call, sizes []int) porcupine.CheckResult {
	t.Helper()
	limit := 0
	for _, q := range sizes {
		limit += q
	}
	sp, ops := translate(calls, limit, sizes, 2, false, 4)
	return porcupine.CheckOperationsTimeout(sp.model(), ops, 10*time.Second)
}

// A drop in sizes: a size sold out answers sold_out while the drop has units left,
// a size sells no more than its quantity, and a cut of one size moves that size.
func TestModelVariants(t *testing.T) {
	admitted := func(key, user string, at int64, size int) hc {
		return hc{kind: kReserve, key: key, user: user, qty: 1, from: at, to: at + 1, status: 201, outcome: "admitted", state: "active", variant: size}
	}
	soldOut := hc{kind: kReserve, key: "b", user: "u2", qty: 1, from: 2, to: 3, status: 409, outcome: "sold_out", variant: 0}
	if r := checkVariants(t, history(admitted("a", "u1", 0, 0), soldOut, admitted("c", "u2", 4, 1)), []int{1, 2}); r != porcupine.Ok {
		t.Fatalf("a sold-out size beside one with units: %v", r)
	}
	if r := checkVariants(t, history(admitted("a", "u1", 0, 0), admitted("b", "u2", 2, 0)), []int{1, 2}); r != porcupine.Illegal {
		t.Fatalf("two pairs of a size with one: %v", r)
	}
	cut := hc{kind: kApply, client: 3, from: 2, to: 3, apply: applyChange{What: "limit", Limit: 1, Variant: 1}}
	if r := checkVariants(t, history(admitted("a", "u1", 0, 1), cut, admitted("b", "u2", 4, 1)), []int{1, 2}); r != porcupine.Illegal {
		t.Fatalf("a size cut to what is held sold again: %v", r)
	}
	if r := checkVariants(t, history(admitted("a", "u1", 0, 1), cut, admitted("b", "u2", 4, 0)), []int{1, 2}); r != porcupine.Ok {
		t.Fatalf("a cut of one size stopped another: %v", r)
	}
}
