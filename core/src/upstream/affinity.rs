//! The node's session pins: a session id (hashed) → the backend serving it, until a deadline.
//! Shared by every worker of the process, and kept across reloads (a pin names a backend by its
//! identity — cluster name and URL — not by its position in one snapshot).
//!
//! A fixed table of atomics, no lock: [`SLOTS`] slots, each id probing [`PROBE`] of them. When
//! they are all taken by live pins the oldest-looking one is overwritten, so the table never
//! grows; a pin lost that way costs one re-pin. A reader racing a writer may see a slot
//! half-written; every pin read is checked against the route's own backends, so the worst case
//! is one request placed as if it had no pin.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Slots in the table (1.5 MiB).
pub(crate) const SLOTS: usize = 1 << 16;
/// Slots one id may use.
const PROBE: usize = 4;

#[derive(Default)]
struct Slot {
    /// The id's hash (never 0: 0 is an empty slot).
    key: AtomicU64,
    /// The backend's identity hash.
    backend: AtomicU64,
    /// Unix seconds until which the pin holds.
    until: AtomicU64,
}

pub(crate) struct PinTable {
    slots: Box<[Slot]>,
}

impl std::fmt::Debug for PinTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinTable({} slots)", self.slots.len())
    }
}

impl Default for PinTable {
    fn default() -> Self {
        PinTable {
            slots: (0..SLOTS).map(|_| Slot::default()).collect(),
        }
    }
}

impl PinTable {
    fn probe(&self, key: u64) -> impl Iterator<Item = &Slot> {
        let start = (key as usize) % self.slots.len();
        (0..PROBE).map(move |i| &self.slots[(start + i) % self.slots.len()])
    }

    /// The backend `id` is pinned to, if the pin still holds at `now` (unix seconds).
    pub(crate) fn get(&self, id: u64, now: u64) -> Option<u64> {
        self.get_until(id, now).map(|(backend, _)| backend)
    }

    /// The pinned backend and until when the pin holds.
    pub(crate) fn get_until(&self, id: u64, now: u64) -> Option<(u64, u64)> {
        let key = id.max(1);
        self.probe(key)
            .find(|s| s.key.load(Relaxed) == key)
            .map(|s| (s.backend.load(Relaxed), s.until.load(Relaxed)))
            .filter(|(_, until)| *until > now)
    }

    /// Pin `id` to `backend` until `until` (unix seconds).
    pub(crate) fn pin(&self, id: u64, backend: u64, until: u64, now: u64) {
        let key = id.max(1);
        let slot = self
            .probe(key)
            .find(|s| s.key.load(Relaxed) == key)
            .or_else(|| {
                self.probe(key)
                    .find(|s| s.key.load(Relaxed) == 0 || s.until.load(Relaxed) <= now)
            })
            .or_else(|| self.probe(key).min_by_key(|s| s.until.load(Relaxed)));
        if let Some(slot) = slot {
            // Deadline last: a reader that sees it sees a live pin (see the module doc).
            slot.until.store(0, Relaxed);
            slot.key.store(key, Relaxed);
            slot.backend.store(backend, Relaxed);
            slot.until.store(until, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_hold_until_their_deadline_and_are_replaced() {
        let t = PinTable::default();
        assert_eq!(t.get(42, 100), None);
        t.pin(42, 7, 200, 100);
        assert_eq!(t.get(42, 100), Some(7));
        assert_eq!(t.get(42, 199), Some(7));
        assert_eq!(t.get(42, 200), None, "expired");
        t.pin(42, 9, 300, 150);
        assert_eq!(t.get(42, 150), Some(9), "re-pinned");
        // Ids that share slots: a fifth evicts the one closest to expiring.
        let base = 5 * SLOTS as u64;
        for i in 0..4u64 {
            t.pin(base + i * SLOTS as u64, i, 1_000 + i, 100);
        }
        t.pin(base + 4 * SLOTS as u64, 4, 2_000, 100);
        assert_eq!(t.get(base, 100), None, "the soonest to expire went");
        assert_eq!(t.get(base + SLOTS as u64, 100), Some(1));
        assert_eq!(t.get(base + 4 * SLOTS as u64, 100), Some(4));
        // Id 0 works (it is stored as 1).
        t.pin(0, 3, 500, 100);
        assert_eq!(t.get(0, 100), Some(3));
    }
}
