//! Rebuild when embedded files change: Lua scripts, SQL migrations, demo
//! config.

fn main() {
    println!("cargo:rerun-if-changed=lua");
    println!("cargo:rerun-if-changed=migrations");
    println!("cargo:rerun-if-changed=config/demo.toml");
    println!("cargo:rerun-if-changed=config/rules.toml");
}
