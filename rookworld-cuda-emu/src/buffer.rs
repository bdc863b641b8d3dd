//! Buffers that end at a guard page: an emulated kernel that reads or writes past a
//! buffer's end faults, and the launch names the kernel, block and thread.

use std::marker::PhantomData;

mod sealed {
    pub trait Sealed {}
}

/// A type a kernel buffer holds: plain numbers (all-zero bytes are a valid value).
pub trait Element: Copy + sealed::Sealed + 'static {}

macro_rules! elements {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {}
    )*};
}
elements!(f32, f64, u16, u32, i32, u64, [i32; 2], [i32; 4], [u32; 4]);

/// `len` values of `T` in their own mapping, 16-byte aligned, followed directly (up to
/// 16-byte rounding) by a page that may not be touched.
pub struct Guarded<T: Element> {
    map: *mut libc::c_void,
    map_len: usize,
    data: *mut T,
    len: usize,
    _values: PhantomData<T>,
}

impl<T: Element> Guarded<T> {
    /// `len` zeros.
    pub fn zeros(len: usize) -> Self {
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let bytes = (len * size_of::<T>()).next_multiple_of(16).max(16);
        let data_pages = bytes.div_ceil(page);
        let map_len = (data_pages + 1) * page;
        // SAFETY: an anonymous private mapping of `map_len` bytes, no address requested.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(
            map != libc::MAP_FAILED,
            "mapping {map_len} bytes for a guarded buffer failed"
        );
        // SAFETY: the last page lies in the mapping just made.
        let guard = unsafe { map.cast::<u8>().add(data_pages * page) };
        // SAFETY: `guard` is page-aligned and one page of the mapping remains from it.
        let protected = unsafe { libc::mprotect(guard.cast(), page, libc::PROT_NONE) };
        assert_eq!(protected, 0, "protecting a guard page failed");
        // SAFETY: `bytes` ≤ data_pages · page, so the data lies in the mapping; 16 divides
        // `bytes` and the page size, so it is 16-byte aligned.
        let data = unsafe { guard.sub(bytes) }.cast::<T>();
        Guarded {
            map,
            map_len,
            data,
            len,
            _values: PhantomData,
        }
    }

    /// A copy of `values`.
    pub fn from_slice(values: &[T]) -> Self {
        let mut b = Self::zeros(values.len());
        b.as_mut_slice().copy_from_slice(values);
        b
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *const T {
        self.data
    }

    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.data
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `data` holds `len` initialised values (zeroed by the mapping, then
        // written only as `T`), alive as long as `self`.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.data, self.len) }
    }

    pub fn to_vec(&self) -> Vec<T> {
        self.as_slice().to_vec()
    }
}

impl<T: Element> Drop for Guarded<T> {
    fn drop(&mut self) {
        // SAFETY: `map` and `map_len` are the mapping made in `zeros`, unmapped once.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

impl<T: Element + std::fmt::Debug> std::fmt::Debug for Guarded<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}
