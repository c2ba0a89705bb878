//! `crds/inventorydrop.yaml` is generated: this fails when the types moved on.

#[test]
fn the_committed_crd_matches_the_types() {
    let generated = dropgate_operator::crd_yaml().expect("CRD serialises");
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../crds/inventorydrop.yaml");
    let committed = std::fs::read_to_string(path).expect("crds/inventorydrop.yaml exists");
    assert!(
        generated == committed,
        "crds/inventorydrop.yaml is stale: run `cargo run -p dropgate-operator -- crdgen > crds/inventorydrop.yaml`"
    );
}
