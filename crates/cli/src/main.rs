fn main() { println!("pliant (being written)"); }
