//! The geometry every packed kernel shares: panels of [`NR`] columns, register tiles of
//! [`MR`] rows, the column order of a BF16 panel row, and the output the threads write.

/// An operand: (values, row stride, column stride).
pub type Strided<'a> = (&'a [f32], usize, usize);

/// Output columns per panel: two 8-lane AVX registers.
pub const NR: usize = 16;
/// Rows per register tile (12 accumulators + 2 weight vectors + 1 broadcast ≤ 16 YMM).
pub(super) const MR: usize = 6;

/// The column each position of a BF16 panel row holds. Unpacking a row's 16 values
/// (one 256-bit load) with zeros puts positions 0..4 and 8..12 into one register's f32
/// lanes and 4..8, 12..16 into the other's (each 128-bit half on its own); in this order
/// that is columns 0..8 and 8..16.
pub const BF16_COLUMNS: [usize; NR] = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15];

/// The output buffer, written by many threads at disjoint places.
#[derive(Clone, Copy)]
pub(super) struct SharedOut(pub(super) *mut f32);

// SAFETY: threads write disjoint column ranges (one panel each), see `matmul`.
unsafe impl Send for SharedOut {}
// SAFETY: as for Send: no two threads write one place, and none reads while they write.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// # Safety
    /// `offset..offset + src.len()` lies in the buffer and no other thread writes it.
    pub(super) unsafe fn write(self, offset: usize, src: &[f32]) {
        // SAFETY: guaranteed by the caller.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.add(offset), src.len()) };
    }

    /// Writes `src` at `offset`, or adds it to what is there when `accumulate`.
    ///
    /// # Safety
    /// As for [`write`](Self::write); nothing else reads the range meanwhile either.
    pub(super) unsafe fn put(self, offset: usize, src: &[f32], accumulate: bool) {
        if !accumulate {
            // SAFETY: guaranteed by the caller.
            return unsafe { self.write(offset, src) };
        }
        // SAFETY: guaranteed by the caller: the range is this thread's alone.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.0.add(offset), src.len()) };
        dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
    }
}
