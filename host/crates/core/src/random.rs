//! Random bytes for ids, tokens and nonces, from the OS random source.
//!
//! Rule: every byte handed out comes from the OS random source (`getrandom`) and is handed
//! out once. A call takes several ids (its call id, its intent id, the render nonce), and
//! a `getrandom` system call each cost ~1 µs on the call's path; so each thread reads
//! [`POOL_BYTES`] at a time and hands them out in order, zeroing what it handed out. A
//! request larger than the pool reads the OS source directly.

use std::cell::RefCell;

/// Bytes read from the OS random source at a time, per thread.
pub const POOL_BYTES: usize = 4096;

struct Pool {
    bytes: [u8; POOL_BYTES],
    /// Bytes before `at` were handed out (and zeroed).
    at: usize,
}

thread_local! {
    static POOL: RefCell<Pool> = const {
        RefCell::new(Pool {
            bytes: [0; POOL_BYTES],
            at: POOL_BYTES,
        })
    };
}

/// Fills `out` with bytes from the OS random source.
///
/// # Panics
/// The OS random source failed (as `getrandom::fill(..).expect(..)` did before).
pub fn fill(out: &mut [u8]) {
    if out.len() > POOL_BYTES / 4 {
        getrandom::fill(out).expect("the OS random generator failed");
        return;
    }
    POOL.with_borrow_mut(|pool| {
        if POOL_BYTES - pool.at < out.len() {
            getrandom::fill(&mut pool.bytes).expect("the OS random generator failed");
            pool.at = 0;
        }
        let taken = &mut pool.bytes[pool.at..pool.at + out.len()];
        out.copy_from_slice(taken);
        taken.fill(0);
        pool.at += out.len();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_handed_out_once_and_requests_of_any_size_are_filled() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..(3 * POOL_BYTES / 16) {
            let mut id = [0u8; 16];
            fill(&mut id);
            assert!(seen.insert(id), "an id came twice");
        }
        let mut big = vec![0u8; POOL_BYTES * 2];
        fill(&mut big);
        assert!(big.iter().any(|&b| b != 0));
        let mut none: [u8; 0] = [];
        fill(&mut none);
    }

    /// What was handed out is no longer in the thread's pool (a later read of the pool,
    /// a core dump, cannot give a token away), and what was not is still there.
    #[test]
    fn handed_out_bytes_are_zeroed_in_the_pool() {
        let mut first = [0u8; 32];
        fill(&mut first);
        let mut second = [0u8; 32];
        fill(&mut second);
        POOL.with_borrow(|pool| {
            assert!(pool.at >= 32);
            assert!(
                pool.bytes[..pool.at].iter().all(|&b| b == 0),
                "handed-out bytes are zeroed"
            );
            assert!(
                pool.bytes[pool.at..].iter().any(|&b| b != 0),
                "the rest is still random"
            );
        });
        assert_ne!(first, [0u8; 32]);
        assert_ne!(first, second);
    }
}
