//! What the UCX tests of this crate share: finding the library.

/// The UCX library to load (`GIN_UCX_LIB`), or `None` after printing why
/// `what` is skipped; where UCX is required (`GIN_REQUIRE_UCX=1`, which
/// `cargo xtask test` sets, or `CI`) a missing library fails the test.
pub fn ucx(what: &str) -> Option<String> {
    let lib = std::env::var("GIN_UCX_LIB")
        .ok()
        .filter(|p| std::path::Path::new(p).exists());
    if lib.is_none() {
        let why = "GIN_UCX_LIB does not name an existing libucp.so.0 (`cargo xtask test` installs the pinned UCX wheel and sets it)";
        let required = std::env::var("GIN_REQUIRE_UCX").is_ok_and(|v| v == "1")
            || std::env::var_os("CI").is_some();
        assert!(
            !required,
            "UCX is required here (GIN_REQUIRE_UCX=1 or CI) but {why}"
        );
        println!("SKIPPED: {what} need UCX: {why}");
    }
    lib
}
