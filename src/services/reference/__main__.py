from services.reference.service import main

raise SystemExit(main())
