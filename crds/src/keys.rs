//! Redis key names. Nothing else in dropgate formats a key.
//!
//! All keys of a drop share the hash tag `{<namespace>/<name>}`: Redis Cluster hashes
//! only what is inside the braces, so the gate's Lua scripts, which touch several keys
//! of one drop atomically, never cross a slot.

/// Key names of one drop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DropKeys {
    /// `dropgate:{namespace/name}`, the common prefix including the hash tag.
    prefix: String,
}

impl DropKeys {
    /// Keys of the drop `name` in `namespace`. Both are Kubernetes object names
    /// (validated by [`is_object_name`]), so they cannot contain `{`, `}` or `:`.
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            prefix: format!("dropgate:{{{namespace}/{name}}}"),
        }
    }

    /// Hash: the drop's published configuration (see [`crate::config`]).
    pub fn config(&self) -> String {
        format!("{}:config", self.prefix)
    }

    /// Integer: units the gate may still admit. Negative after a cut below what is
    /// held, so that returned units pay the deficit back before anything is re-sold.
    pub fn remaining(&self) -> String {
        format!("{}:remaining", self.prefix)
    }

    /// Integer: units held by active or confirmed reservations (status `reserved`).
    pub fn held(&self) -> String {
        format!("{}:held", self.prefix)
    }

    /// Hash: user -> units that user holds, for the per-user limit.
    pub fn buyers(&self) -> String {
        format!("{}:buyers", self.prefix)
    }

    /// Sorted set: idempotency keys of active reservations scored by their deadline
    /// (ms since the epoch), so the sweeper finds due holds without scanning.
    pub fn holds(&self) -> String {
        format!("{}:holds", self.prefix)
    }

    /// Hash: the reservation marker of one idempotency key (user, quantity, state,
    /// deadline). It outlives the hold so that a late retry is still recognised.
    pub fn reservation(&self, key: &str) -> String {
        format!("{}:res:{key}", self.prefix)
    }

    /// Glob matching every reservation marker of the drop (cleanup only).
    /// Every key of the drop, as a SCAN pattern (the hash tag's braces are literal).
    pub fn pattern(&self) -> String {
        format!("{}:*", self.prefix)
    }

    pub fn reservation_pattern(&self) -> String {
        format!("{}:res:*", self.prefix)
    }

    /// Stream: the outbox's events for this drop; consumers read it.
    pub fn events(&self) -> String {
        format!("{}:events", self.prefix)
    }

    /// Integer: the gate's epoch while the gate is open; `closed:<epoch>` once it
    /// was closed for a move of the drop's authority to that epoch (an opening at an
    /// older epoch is refused: it began before the move), or absent (never opened,
    /// or lost with Redis's data). A sidecar opens it (at the ledger's authority epoch) only after Redis holds
    /// everything the ledger recorded, so a Redis that lost its data (this key with
    /// it) admits nothing until it was rebuilt. Every recorded gate change carries
    /// the epoch it was made under, and the ledger refuses one from another epoch.
    pub fn gate(&self) -> String {
        format!("{}:gate", self.prefix)
    }

    /// Integer: one more on every change the ledger records (admission, confirm,
    /// cancel, expiry). The ledger keeps each change's number: a Redis that hands out
    /// a number the ledger already holds, or whose counter is below the ledger's
    /// highest, lost acknowledged writes.
    pub fn seq(&self) -> String {
        format!("{}:seq", self.prefix)
    }

    /// String: the id of the sale's ledger, the one ledger whose sidecars may change
    /// the sale. The first sidecar to open the drop's gate or hand it to the ledger
    /// claims it; the operator keeps it in the drop's status and writes it back when
    /// it seeds a Redis that lost its data. Where the config's `claims` field says
    /// `recorded` (the operator), a claim is [`PROVISIONAL`] until the operator has
    /// the id in status and writes it here: nothing is sold before the claim is
    /// durable, so a Redis that loses it always gets it back. A sidecar with another
    /// ledger (per-pod ledgers on several replicas, a ledger added mid-sale) sees only
    /// part of the sale, so the gate refuses its changes.
    pub fn ledger(&self) -> String {
        format!("{}:ledger", self.prefix)
    }

    /// Sorted set: idempotency keys whose change is still unresolved, scored by when
    /// it becomes overdue: an admission still pending (admitted, not yet durable) or
    /// a confirm or cancel prepared and not yet finished. One its sidecar never
    /// finished (it died) is resolved then, not at the end of its hold.
    pub fn pending(&self) -> String {
        format!("{}:pending", self.prefix)
    }

    /// String: written by the operator when it deletes the drop, before the config:
    /// a sidecar that finds a drop's config gone forgets the drop (`not_found`) only
    /// with this beside it; without it the config was lost (a Redis that lost its
    /// data) and the drop answers `unavailable` until the operator publishes it again.
    /// Removed when a drop of that name is published again; it expires by itself.
    pub fn deleted(&self) -> String {
        format!("{}:deleted", self.prefix)
    }

    /// Hash: each variant's stock, for a drop with variants: `r:<variant>` what it
    /// may still admit (below zero while a cut is paid back), `h:<variant>` what its
    /// reservations hold. The drop's `remaining` and `held` count all of them.
    pub fn variants(&self) -> String {
        format!("{}:variants", self.prefix)
    }

    /// Sorted set, every score 0 so that it is ordered by member: one member
    /// `<user>\n<admitted at, ms since the epoch, 13 digits>\n<key>` for each
    /// reservation Redis made or replayed, so that a buyer's reservations, newest
    /// first, are one range read (`ZREVRANGEBYLEX`). Users and keys hold no control
    /// characters, so the line breaks separate them.
    pub fn by_buyer(&self) -> String {
        format!("{}:by-buyer", self.prefix)
    }

    /// Sorted set: the waitlist line of `variant` (`""` for a drop without
    /// variants): entry keys scored by their position. The gate's scripts derive
    /// the waitlist's names from [`DropKeys::config`]'s prefix (an offer touches
    /// entries no caller names beforehand); they share the drop's hash tag.
    pub fn waitlist_line(&self, variant: &str) -> String {
        format!("{}:wl:line:{variant}", self.prefix)
    }

    /// Hash: one waitlist entry (user, quantity, variant, state, position, the
    /// join's attempt, sale).
    pub fn waitlist_entry(&self, key: &str) -> String {
        format!("{}:wl:entry:{key}", self.prefix)
    }

    /// Hash: user -> units that user waits for in the drop's lines.
    pub fn waitlist_users(&self) -> String {
        format!("{}:wl:users", self.prefix)
    }

    /// Integer: the lines' position counter.
    pub fn waitlist_counter(&self) -> String {
        format!("{}:wl:n", self.prefix)
    }

    /// Every waitlist key of the drop, as a SCAN pattern (cleanup only).
    pub fn waitlist_pattern(&self) -> String {
        format!("{}:wl:*", self.prefix)
    }

    /// Every fixed key of the drop, config first: deleting in this order stops
    /// sidecars from admitting before the stock disappears.
    pub fn fixed(&self) -> [String; 12] {
        [
            self.config(),
            self.gate(),
            self.remaining(),
            self.variants(),
            self.held(),
            self.buyers(),
            self.holds(),
            self.pending(),
            self.seq(),
            self.ledger(),
            self.by_buyer(),
            self.events(),
        ]
    }
}

/// The prefix of a claim of the sale's ledger that the operator has not recorded
/// yet (see [`DropKeys::ledger`]): `claimed:<ledger id>`.
pub const PROVISIONAL: &str = "claimed:";

/// How claims of a sale's ledger take effect, the config's `claims` field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claims {
    /// Once the operator recorded the claim in the drop's status (Kubernetes).
    Recorded,
    /// At once: nobody keeps a status (`dropgate-operator apply`).
    Immediate,
}

impl Claims {
    pub fn as_str(self) -> &'static str {
        match self {
            Claims::Recorded => "recorded",
            Claims::Immediate => "immediate",
        }
    }
}

/// A drop's key in the SQL ledger: `namespace/name/sale`. The sale (the
/// InventoryDrop's uid; outside Kubernetes the manifest's `metadata.uid`, or a fixed
/// word) makes a drop deleted and re-created under the same name a new sale with
/// rows of its own.
pub fn ledger_key(namespace: &str, name: &str, sale: &str) -> String {
    format!("{namespace}/{name}/{sale}")
}

/// The `namespace/name` part of a ledger key (what outbox events call the drop).
pub fn ledger_drop(ledger_key: &str) -> &str {
    ledger_key
        .rsplit_once('/')
        .map_or(ledger_key, |(drop, _sale)| drop)
}

/// The sale part of a ledger key.
pub fn ledger_sale(ledger_key: &str) -> &str {
    ledger_key.rsplit_once('/').map_or("", |(_drop, sale)| sale)
}

/// Key names of one fencing-token lock of a namespace. Both keys share the hash tag
/// `{namespace/lock}`, so the acquire script touches one slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockKeys {
    prefix: String,
}

impl LockKeys {
    /// `name` must not contain `{` or `}` (see [`is_lock_name`]).
    pub fn new(namespace: &str, name: &str) -> Self {
        Self {
            prefix: format!("dropgate:lock:{{{namespace}/{name}}}"),
        }
    }

    /// String: the holder's token, with the lease as its TTL.
    pub fn lock(&self) -> String {
        self.prefix.clone()
    }

    /// Sorted set: the lock names of `namespace` in use, each scored with when its
    /// keys lapse (a day past its last lease): what bounds the names a namespace
    /// holds at once. Its own slot (one per namespace), apart from the locks'.
    pub fn names(namespace: &str) -> String {
        format!("dropgate:locks:{{{namespace}}}:names")
    }

    /// Integer: the lock's last fence, which only grows (see the acquire script: a
    /// fence is never below Redis's clock in microseconds, so it keeps growing when
    /// Redis lost the counter, or when this key expired a day after the last lease).
    pub fn fence(&self) -> String {
        format!("{}:fence", self.prefix)
    }
}

/// Whether `s` can name a lock: 1 to 256 bytes, no braces (they would break the
/// hash tag).
pub fn is_lock_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= crate::MAX_ID_BYTES && !s.contains(['{', '}'])
}

/// Whether `s` is a valid Kubernetes object name (RFC 1123 subdomain): what a drop's
/// name and namespace must be, and what keeps key names unambiguous.
pub fn is_object_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_a_drop_shares_one_hash_tag() {
        let keys = DropKeys::new("shop", "sneaker-0412");
        let mut all = keys.fixed().to_vec();
        all.push(keys.reservation("order-1"));
        for key in all {
            assert!(key.starts_with("dropgate:{shop/sneaker-0412}:"), "{key}");
        }
        assert_eq!(keys.events(), "dropgate:{shop/sneaker-0412}:events");
    }

    #[test]
    fn object_names_follow_rfc_1123() {
        for ok in ["a", "sneaker-0412", "x.y-z", "0"] {
            assert!(is_object_name(ok), "{ok}");
        }
        for bad in [
            "",
            "A",
            "a_b",
            "-a",
            "a-",
            "a..b",
            "a}b",
            "a/b",
            &"a".repeat(254),
        ] {
            assert!(!is_object_name(bad), "{bad}");
        }
    }
}
