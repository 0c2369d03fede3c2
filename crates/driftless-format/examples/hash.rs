//! Prints the weights root of a safetensors file or checkpoint directory.
//!
//! `cargo run -p driftless-format --example hash -- PATH`
//! (the library call behind `driftless hash`).

fn main() {
    let Some(path) = std::env::args_os().nth(1) else {
        eprintln!("usage: hash PATH");
        std::process::exit(2);
    };
    match driftless_format::Checkpoint::open(&path) {
        Ok(ck) => println!("{}", driftless_format::weights_root(&ck.views()).1),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
