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

#[test]
fn the_chart_installs_the_same_crd() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let read = |path: &str| {
        std::fs::read_to_string(format!("{root}/{path}")).unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    assert!(
        read("crds/inventorydrop.yaml") == read("charts/dropgate/files/inventorydrop.yaml"),
        "the chart's CRD is stale: cp crds/inventorydrop.yaml charts/dropgate/files/inventorydrop.yaml"
    );
}
