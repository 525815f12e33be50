#![no_main]
// See core/src/fuzzing.rs for what the target checks.
libfuzzer_sys::fuzz_target!(|data: &[u8]| sluice::fuzzing::translate(data));
