//! Entries in a vector, each at an index that stays its own until it is given back, and the
//! given-back places reused before the vector grows: the bookkeeping of the worker's client
//! socket set ([`super::sock::SocketSet`]) and its list of deadlines ([`super::deadlines`]).
//! What a given-back entry means is the holder's (a socket of -1, a free state): it stays in
//! place until the next insert overwrites it, and the holder's loops over all entries pass
//! over it.

/// See the module's doc.
#[derive(Debug)]
pub(crate) struct Slab<T> {
    entries: Vec<T>,
    /// Indexes given back, for the next inserts.
    free: Vec<usize>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab::new()
    }
}

impl<T> Slab<T> {
    pub(crate) const fn new() -> Slab<T> {
        Slab {
            entries: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Put `entry` in a given-back place, or a new one; returns its index.
    pub(crate) fn insert(&mut self, entry: T) -> usize {
        match self.free.pop() {
            Some(index) => {
                if let Some(place) = self.entries.get_mut(index) {
                    *place = entry;
                }
                index
            }
            None => {
                self.entries.push(entry);
                self.entries.len() - 1
            }
        }
    }

    /// Give `index` back for a later insert. Once only: the holder knows (by what it left in
    /// the entry) whether it already did.
    pub(crate) fn give_back(&mut self, index: usize) {
        self.free.push(index);
    }

    pub(crate) fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        self.entries.get_mut(index)
    }

    /// Every entry, given back or not.
    pub(crate) fn iter(&self) -> std::slice::Iter<'_, T> {
        self.entries.iter()
    }

    /// Every entry, given back or not.
    pub(crate) fn iter_mut(&mut self) -> std::slice::IterMut<'_, T> {
        self.entries.iter_mut()
    }

    /// How many entries are held (not given back), and how many places were made.
    #[cfg(test)]
    pub(crate) fn counts(&self) -> (usize, usize) {
        (self.entries.len() - self.free.len(), self.entries.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_back_places_are_reused_before_the_slab_grows() {
        let mut slab = Slab::new();
        let a = slab.insert('a');
        let b = slab.insert('b');
        assert_eq!((a, b), (0, 1));
        slab.give_back(a);
        assert_eq!(slab.counts(), (1, 2));
        assert_eq!(slab.insert('c'), a, "the given-back place");
        assert_eq!(slab.get_mut(a), Some(&mut 'c'));
        assert_eq!(slab.insert('d'), 2, "a new one");
        assert_eq!(slab.iter().copied().collect::<String>(), "cbd");
        assert_eq!(slab.counts(), (3, 3));
    }
}
