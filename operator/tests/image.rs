//! The image both binaries ship in: its bases pinned by digest (a tag can be moved
//! to other contents, a digest cannot), and run as a non-root user.

fn dockerfile() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../Dockerfile");
    std::fs::read_to_string(path).expect("the Dockerfile exists")
}

#[test]
fn every_base_image_is_pinned_by_digest() {
    let dockerfile = dockerfile();
    let bases: Vec<&str> = dockerfile
        .lines()
        .filter_map(|line| line.strip_prefix("FROM "))
        .filter_map(|rest| rest.split_whitespace().next())
        .collect();
    assert_eq!(bases.len(), 2, "a build stage and the image: {bases:?}");
    for base in bases {
        let digest = base.split_once("@sha256:").map(|(_, digest)| digest);
        assert!(
            digest.is_some_and(|d| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit())),
            "{base} is not pinned by a sha256 digest"
        );
    }
}

#[test]
fn the_image_runs_as_a_non_root_user() {
    let dockerfile = dockerfile();
    let user = dockerfile
        .lines()
        .rev()
        .find_map(|line| line.strip_prefix("USER "))
        .expect("a USER line");
    let uid: u32 = user
        .trim()
        .parse()
        .expect("a numeric uid (runAsNonRoot can check it)");
    assert_ne!(uid, 0);
}

/// Release builds are stripped (the sidecar is pulled by every pod a sale scales
/// out): 19.0 MB for the sidecar and 20.8 MB for the operator when measured, not the
/// ~140 MB each with line tables. `--profile release-debug` keeps them.
#[test]
fn release_builds_are_stripped() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    let manifest = std::fs::read_to_string(path).expect("the workspace manifest");
    let release = manifest
        .split("\n[")
        .find(|section| section.starts_with("profile.release]"))
        .expect("a [profile.release] section");
    assert!(
        release
            .lines()
            .any(|line| line.replace(' ', "") == "strip=true"),
        "[profile.release] does not strip: {release}"
    );
}
