//! Rebuild when the embedded Lua script or demo files change.

fn main() {
    println!("cargo:rerun-if-changed=lua");
    println!("cargo:rerun-if-changed=config/demo.toml");
    println!("cargo:rerun-if-changed=config/rules.toml");
}
