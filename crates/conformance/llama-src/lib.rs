//! Empty: this package only pins llama-cpp-sys-2 0.1.161 for `cargo fetch`.
