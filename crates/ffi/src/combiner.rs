//! C combiners for coherent shared state.
//!
//! The state library takes a plain `fn(&mut Vec<u8>, &[u8])` (a combiner must mean the same on
//! every replica, so it carries no per-instance context). A C function pointer cannot be
//! captured by such a `fn`, so each registered C combiner gets one of [`MAX_C_COMBINERS`]
//! monomorphised trampolines, each reading its C function from a process-wide slot. A slot is
//! written once and never reused, so a trampoline handed to the state library stays valid for
//! the life of the process (the library may call it long after `pliant_create_shared`).

use pliant_state::Combiner;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// A C combiner: merges `other` into `acc` in place (`acc_len` bytes, the key's value size).
/// Must be associative and commutative and must accept any `other` (it may come from another
/// replica, of another length).
pub type PliantCombinerFn =
    Option<unsafe extern "C" fn(acc: *mut u8, acc_len: usize, other: *const u8, other_len: usize)>;

/// Distinct C combiner functions per process (registering the same function again reuses its
/// slot). Real NFs have one or two; the bound keeps the registry static.
pub const MAX_C_COMBINERS: usize = 16;

static SLOTS: [AtomicUsize; MAX_C_COMBINERS] = [const { AtomicUsize::new(0) }; MAX_C_COMBINERS];
/// Serialises registration (lookups are lock-free).
static REGISTER: Mutex<()> = Mutex::new(());

fn trampoline<const I: usize>(acc: &mut Vec<u8>, other: &[u8]) {
    let raw = SLOTS[I].load(Ordering::Acquire);
    if raw == 0 {
        return;
    }
    // SAFETY: slot I only ever holds a non-null `unsafe extern "C" fn` of the PliantCombinerFn
    // signature (written by `register`), and function pointers are never freed.
    let f: unsafe extern "C" fn(*mut u8, usize, *const u8, usize) =
        unsafe { std::mem::transmute::<usize, _>(raw) };
    // SAFETY: both pointers are valid for the lengths given for the duration of the call.
    unsafe { f(acc.as_mut_ptr(), acc.len(), other.as_ptr(), other.len()) }
}

const TRAMPOLINES: [Combiner; MAX_C_COMBINERS] = [
    trampoline::<0>,
    trampoline::<1>,
    trampoline::<2>,
    trampoline::<3>,
    trampoline::<4>,
    trampoline::<5>,
    trampoline::<6>,
    trampoline::<7>,
    trampoline::<8>,
    trampoline::<9>,
    trampoline::<10>,
    trampoline::<11>,
    trampoline::<12>,
    trampoline::<13>,
    trampoline::<14>,
    trampoline::<15>,
];

/// The Rust combiner standing for C function `f`; `None` when all slots hold other functions.
pub fn register(f: unsafe extern "C" fn(*mut u8, usize, *const u8, usize)) -> Option<Combiner> {
    let raw = f as usize;
    let _g = REGISTER.lock().unwrap_or_else(|e| e.into_inner());
    for (i, slot) in SLOTS.iter().enumerate() {
        let cur = slot.load(Ordering::Acquire);
        if cur == raw {
            return Some(TRAMPOLINES[i]);
        }
        if cur == 0 {
            slot.store(raw, Ordering::Release);
            return Some(TRAMPOLINES[i]);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    unsafe extern "C" fn xor_into(acc: *mut u8, acc_len: usize, other: *const u8, n: usize) {
        for i in 0..acc_len.min(n) {
            *acc.add(i) ^= *other.add(i);
        }
    }

    unsafe extern "C" fn or_into(acc: *mut u8, acc_len: usize, other: *const u8, n: usize) {
        for i in 0..acc_len.min(n) {
            *acc.add(i) |= *other.add(i);
        }
    }

    #[test]
    fn registered_functions_run_through_their_own_trampoline() {
        let x = register(xor_into).expect("slot");
        let o = register(or_into).expect("slot");
        assert_eq!(register(xor_into).expect("slot") as usize, x as usize);
        assert_ne!(x as usize, o as usize);
        let mut acc = vec![0b1100u8, 1];
        x(&mut acc, &[0b1010, 1, 99]);
        assert_eq!(acc, vec![0b0110, 0]);
        o(&mut acc, &[0b0001]);
        assert_eq!(acc, vec![0b0111, 0]);
    }
}
