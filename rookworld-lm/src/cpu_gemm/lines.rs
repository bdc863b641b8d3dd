//! [`Lines`]: a buffer whose first value starts a cache line. AMX loads a tile row of 64
//! bytes at a time; a row that straddles two lines costs two, and on a Xeon a product
//! over operands 16 bytes off the line (what `malloc` gives large buffers) ran at a third
//! of the rate of the same product over aligned ones.

/// The alignment: a cache line, a tile row.
const LINE: usize = 64;

/// `len` values of `T`, the first at a 64-byte boundary; dereferences to the slice.
#[derive(Debug, Default)]
pub(crate) struct Lines<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: Copy + Default> Lines<T> {
    /// No values.
    pub(crate) const fn new() -> Self {
        Self {
            buf: Vec::new(),
            start: 0,
            len: 0,
        }
    }

    /// `len` values of `T::default()`.
    pub(crate) fn zeroed(len: usize) -> Self {
        let mut lines = Self::new();
        lines.reset(len);
        lines
    }

    /// Makes this `len` values of `T::default()`, reusing the memory where it is enough.
    pub(crate) fn reset(&mut self, len: usize) {
        let spare = LINE.div_ceil(size_of::<T>().max(1));
        self.buf.clear();
        self.buf.resize(len + spare, T::default());
        let misalign = self.buf.as_ptr() as usize % LINE;
        self.start = if misalign == 0 {
            0
        } else {
            (LINE - misalign) / size_of::<T>().max(1)
        };
        self.len = len;
    }

    /// Makes this `len` values long, its values unspecified (what the memory held): for a
    /// buffer every value of which is written before it is read.
    pub(crate) fn fit(&mut self, len: usize) {
        if self.start + len <= self.buf.len() {
            self.len = len;
        } else {
            self.reset(len);
        }
    }

    /// Values the memory holds without growing.
    pub(crate) fn capacity(&self) -> usize {
        self.buf
            .capacity()
            .saturating_sub(LINE.div_ceil(size_of::<T>().max(1)))
    }
}

impl<T: Copy + Default> Clone for Lines<T> {
    fn clone(&self) -> Self {
        // A copy of the Vec starts wherever the allocator puts it: align it again.
        let mut copy = Self::zeroed(self.len);
        copy.copy_from_slice(self);
        copy
    }
}

impl<T: PartialEq> PartialEq for Lines<T> {
    /// Equal values (wherever each starts in its memory).
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T> std::ops::Deref for Lines<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl<T> std::ops::DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_start_a_line_when_made_reset_or_cloned() {
        for len in [0, 1, 31, 1000, 100_000] {
            let mut a = Lines::<u16>::zeroed(len);
            assert_eq!((a.as_ptr() as usize % LINE, a.len()), (0, len));
            assert!(a.iter().all(|&v| v == 0));
            a.iter_mut().for_each(|v| *v = 7);
            let b = a.clone();
            assert_eq!((b.as_ptr() as usize % LINE, &b[..]), (0, &a[..]));
            a.reset(len / 2);
            assert_eq!((a.as_ptr() as usize % LINE, a.len()), (0, len / 2));
            assert!(a.iter().all(|&v| v == 0), "reset zeroes");
            let bytes = Lines::<i8>::zeroed(len);
            assert_eq!(bytes.as_ptr() as usize % LINE, 0);
        }
    }
}
