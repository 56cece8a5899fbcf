fn main() {
    // sqlx::migrate! embeds the files that exist when `shared` builds: rebuild when one is added.
    println!("cargo:rerun-if-changed=../migrations");
}
