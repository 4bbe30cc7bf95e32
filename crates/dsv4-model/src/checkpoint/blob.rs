//! Byte ranges of memory-mapped shards.

use std::ops::Range;
use std::sync::Arc;

use memmap2::Mmap;

enum Backing {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A byte range of a shared buffer (a memory-mapped shard, or owned bytes for tests and
/// converted data). Cloning and slicing never copy the bytes.
#[derive(Clone)]
pub struct Blob {
    backing: Arc<Backing>,
    start: usize,
    len: usize,
}

impl Blob {
    /// The whole of a memory map.
    pub fn from_mmap(map: Mmap) -> Blob {
        let len = map.len();
        Blob {
            backing: Arc::new(Backing::Mmap(map)),
            start: 0,
            len,
        }
    }

    pub fn from_vec(bytes: Vec<u8>) -> Blob {
        let len = bytes.len();
        Blob {
            backing: Arc::new(Backing::Owned(bytes)),
            start: 0,
            len,
        }
    }

    #[inline]
    pub fn bytes(&self) -> &[u8] {
        &self.backing.bytes()[self.start..self.start + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A sub-range, relative to this blob; `None` if it does not lie inside it.
    pub fn slice(&self, range: Range<usize>) -> Option<Blob> {
        (range.start <= range.end && range.end <= self.len).then(|| Blob {
            backing: self.backing.clone(),
            start: self.start + range.start,
            len: range.end - range.start,
        })
    }
}

impl std::fmt::Debug for Blob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Blob[{}..{}]", self.start, self.start + self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_share_bytes_and_check_bounds() {
        let b = Blob::from_vec((0u8..10).collect());
        let s = b.slice(2..8).unwrap();
        assert_eq!(s.bytes(), &[2, 3, 4, 5, 6, 7]);
        let t = s.slice(1..3).unwrap();
        assert_eq!(t.bytes(), &[3, 4]);
        assert!(s.slice(5..7).is_none());
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = s.slice(3..1);
        assert!(reversed.is_none());
        assert_eq!(s.slice(6..6).unwrap().len(), 0);
    }
}
